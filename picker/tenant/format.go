package tenant

import "strconv"

func itoa(v int64) string { return strconv.FormatInt(v, 10) }

func trimFloat(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) }
