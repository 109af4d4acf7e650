package prefix

// table is an open-addressing hash table from block hashes to V, with
// linear probing and backward-shift deletion. Unlike a Go map under the
// constant insert/delete churn of an LRU, it never accumulates tombstones,
// so a miss costs one or two cache lines. Keys are already well mixed, but
// a multiplicative step spreads sequential test keys too.
type table[V any] struct {
	// keys and vals are parallel arrays: a miss probes only keys (eight
	// per cache line) and a hit reads one value. Key 0 marks an empty slot;
	// a real key 0 is stored as zeroKey (a key equal to zeroKey would be
	// confused with it, a 2^-64 chance for hash keys).
	keys  []uint64
	vals  []V
	n     int
	shift uint8 // 64 - log2(len(keys))
}

const zeroKey uint64 = 0x6a09e667f3bcc909

func fixKey(k uint64) uint64 {
	if k == 0 {
		return zeroKey
	}
	return k
}

// minTableSize is the smallest slot array; a power of two.
const minTableSize = 8

func newTable[V any](capacity int) table[V] {
	size := minTableSize
	for size*3/4 < capacity {
		size *= 2
	}
	return table[V]{keys: make([]uint64, size), vals: make([]V, size), shift: uint8(64 - log2(size))}
}

func log2(n int) int {
	r := 0
	for n > 1 {
		n >>= 1
		r++
	}
	return r
}

func (t *table[V]) home(k uint64) int { return int((k * 0x9e3779b97f4a7c15) >> t.shift) }

func (t *table[V]) mask() int { return len(t.keys) - 1 }

// find returns the slot index holding k (already fixed), or -1.
func (t *table[V]) find(k uint64) int {
	if len(t.keys) == 0 {
		return -1
	}
	m := t.mask()
	for i := t.home(k); ; i = (i + 1) & m {
		switch t.keys[i] {
		case k:
			return i
		case 0:
			return -1
		}
	}
}

// get returns a pointer to k's value (valid until the next put or del).
func (t *table[V]) get(k uint64) (*V, bool) {
	i := t.find(fixKey(k))
	if i < 0 {
		return nil, false
	}
	return &t.vals[i], true
}

// put inserts or replaces k's value.
func (t *table[V]) put(k uint64, v V) {
	k = fixKey(k)
	if (t.n+1)*4 > len(t.keys)*3 {
		t.resize(max(minTableSize, len(t.keys)*2))
	}
	m := t.mask()
	for i := t.home(k); ; i = (i + 1) & m {
		switch t.keys[i] {
		case 0:
			t.keys[i], t.vals[i] = k, v
			t.n++
			return
		case k:
			t.vals[i] = v
			return
		}
	}
}

// del removes k, shifting later entries of its probe run back so lookups
// never need tombstones. It shrinks a table that became mostly empty.
func (t *table[V]) del(k uint64) bool {
	i := t.find(fixKey(k))
	if i < 0 {
		return false
	}
	m := t.mask()
	for j := (i + 1) & m; t.keys[j] != 0; j = (j + 1) & m {
		// Move j into the hole at i if i lies on j's probe path.
		if (j-t.home(t.keys[j]))&m >= (j-i)&m {
			t.keys[i], t.vals[i] = t.keys[j], t.vals[j]
			i = j
		}
	}
	var zero V
	t.keys[i], t.vals[i] = 0, zero
	t.n--
	if len(t.keys) > 64 && t.n*8 < len(t.keys) {
		t.resize(len(t.keys) / 2)
	}
	return true
}

func (t *table[V]) resize(size int) {
	oldK, oldV := t.keys, t.vals
	t.keys, t.vals = make([]uint64, size), make([]V, size)
	t.shift = uint8(64 - log2(size))
	t.n = 0
	m := t.mask()
	for i, k := range oldK {
		if k == 0 {
			continue
		}
		j := t.home(k)
		for t.keys[j] != 0 {
			j = (j + 1) & m
		}
		t.keys[j], t.vals[j] = k, oldV[i]
		t.n++
	}
}

// each calls f for every entry (a stored zeroKey is reported as 0).
func (t *table[V]) each(f func(k uint64, v *V)) {
	for i, k := range t.keys {
		if k == 0 {
			continue
		}
		if k == zeroKey {
			k = 0
		}
		f(k, &t.vals[i])
	}
}

// bytes is the table's slot arrays' size.
func (t *table[V]) bytes(valSize int) int64 { return int64(len(t.keys)) * int64(8+valSize) }
