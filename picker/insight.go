package picker

import (
	"bytes"
	"strconv"
	"strings"
	"sync"

	"github.com/switchyard/switchyard/picker/decisions"
)

// What the observer stages (trace.go, records.go) share: the split of a
// destination list, and each pool view's tables of addresses and scorers.

// destination splits a decision's destination list into the primary and
// the fallbacks, with the pool's own address strings (no copies).
func destination(pv *poolView, dest []byte, code int) (string, []string) {
	if code != 0 || len(dest) == 0 || pv == nil {
		return "", nil
	}
	var picked string
	var fallbacks []string
	for len(dest) > 0 {
		part := dest
		if i := bytes.IndexByte(dest, ','); i >= 0 {
			part, dest = dest[:i], dest[i+1:]
		} else {
			dest = nil
		}
		var addr string
		if e := pv.byAddr[string(part)]; e != nil {
			addr = e.Address
		} else {
			addr = string(part)
		}
		if picked == "" {
			picked = addr
		} else {
			fallbacks = append(fallbacks, addr)
		}
	}
	return picked, fallbacks
}

// recordTables are a pool view's tables that its decision records
// share: the endpoints' addresses (candidates are indexes into it) and
// the profile's scorers that run.
type recordTables struct {
	once    sync.Once
	addrs   []string
	scorers []decisions.Scorer
	// scorerList is the scorers as a span names them: "prefix*3 queue*2".
	scorerList string
}

func (pv *poolView) recordTables() *recordTables {
	t := &pv.tables
	t.once.Do(func() {
		t.addrs = make([]string, len(pv.eps))
		for i, e := range pv.eps {
			t.addrs[i] = e.Address
		}
		var list []string
		for _, ws := range pv.profile.Scorers {
			if ws.Weight != 0 {
				t.scorers = append(t.scorers, decisions.Scorer{Name: ws.Scorer.Name(), Weight: ws.Weight})
				list = append(list, ws.Scorer.Name()+"*"+strconv.FormatFloat(ws.Weight, 'g', -1, 64))
			}
		}
		t.scorerList = strings.Join(list, " ")
	})
	return t
}
