package load

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// ParseStages parses "10:30s,50:1m": comma-separated value:duration pairs.
// The value is a rate (requests/s) for open-loop arrivals and a concurrency
// for ArrivalConcurrency.
func ParseStages(s string, arrival ArrivalKind) ([]Stage, error) {
	var out []Stage
	for i, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		val, dur, ok := strings.Cut(part, ":")
		if !ok {
			return nil, fmt.Errorf("stage %d %q: want value:duration, e.g. 10:30s", i, part)
		}
		d, err := time.ParseDuration(strings.TrimSpace(dur))
		if err != nil {
			return nil, fmt.Errorf("stage %d %q: duration: %w", i, part, err)
		}
		st := Stage{Duration: d}
		if arrival == ArrivalConcurrency {
			n, err := strconv.Atoi(strings.TrimSpace(val))
			if err != nil {
				return nil, fmt.Errorf("stage %d %q: concurrency: %w", i, part, err)
			}
			st.Concurrency = n
		} else {
			r, err := strconv.ParseFloat(strings.TrimSpace(val), 64)
			if err != nil {
				return nil, fmt.Errorf("stage %d %q: rate: %w", i, part, err)
			}
			st.Rate = r
		}
		out = append(out, st)
	}
	return out, nil
}

// ParseLoRA parses "sql-lora:0.2,other:0.1" into adapter fractions. An empty
// string means no LoRA traffic.
func ParseLoRA(s string) ([]LoRASplit, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []LoRASplit
	for _, part := range strings.Split(s, ",") {
		name, frac, ok := strings.Cut(strings.TrimSpace(part), ":")
		if !ok || name == "" {
			return nil, fmt.Errorf("lora %q: want adapter:fraction, e.g. sql-lora:0.2", part)
		}
		f, err := strconv.ParseFloat(frac, 64)
		if err != nil {
			return nil, fmt.Errorf("lora %q: fraction: %w", part, err)
		}
		out = append(out, LoRASplit{Adapter: name, Fraction: f})
	}
	return out, nil
}

// ParseRange parses "128" (fixed) or "64-256" (inclusive range).
func ParseRange(s string) (Range, error) {
	lo, hi, isRange := strings.Cut(strings.TrimSpace(s), "-")
	a, err := strconv.Atoi(lo)
	if err != nil {
		return Range{}, fmt.Errorf("length %q: want N or MIN-MAX: %w", s, err)
	}
	if !isRange {
		return Fixed(a), nil
	}
	b, err := strconv.Atoi(hi)
	if err != nil {
		return Range{}, fmt.Errorf("length %q: want N or MIN-MAX: %w", s, err)
	}
	if b < a {
		return Range{}, fmt.Errorf("length %q: max below min", s)
	}
	return Range{Min: a, Max: b}, nil
}

// ParseHeader parses "Name: value" as curl's -H does.
func ParseHeader(s string) (name, value string, err error) {
	name, value, ok := strings.Cut(s, ":")
	name = strings.TrimSpace(name)
	if !ok || name == "" || strings.ContainsAny(name, " \t") {
		return "", "", fmt.Errorf("header %q: want 'Name: value'", s)
	}
	return name, strings.TrimSpace(value), nil
}
