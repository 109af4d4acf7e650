package idtable

import (
	"fmt"
	"slices"
	"sync"
	"testing"
)

type entry struct {
	name string
	id   uint16
}

func add(t *Table[entry], name string) *entry {
	return t.Add(name, func(id uint16, _ int) *entry { return &entry{name: name, id: id} })
}

func TestAddReusesFreedIDsAndStopsAtMax(t *testing.T) {
	var tb Table[entry]
	tb.Init(3)
	a, b, c := add(&tb, "a"), add(&tb, "b"), add(&tb, "c")
	if a.id != 0 || b.id != 1 || c.id != 2 {
		t.Fatalf("ids %d %d %d, want 0 1 2", a.id, b.id, c.id)
	}
	if again := add(&tb, "b"); again != b {
		t.Fatalf("Add of an existing name made a new entry %+v", again)
	}
	if d := add(&tb, "d"); d != nil {
		t.Fatalf("a full table added %+v", d)
	}
	var left int
	tb.Remove("b", func(v *entry, n int) {
		if v != b {
			t.Errorf("drop got %+v, want b", v)
		}
		left = n
	})
	if left != 2 {
		t.Errorf("drop told %d entries remain, want 2", left)
	}
	if tb.Get("b") != nil || tb.Load().ByID[1] != nil {
		t.Fatal("b still published after Remove")
	}
	d := add(&tb, "d")
	if d == nil || d.id != 1 {
		t.Fatalf("d = %+v, want b's freed id 1", d)
	}
	if s := tb.Load(); s.ByID[1] != d || s.ByName["d"] != d {
		t.Fatalf("snapshot does not publish d: %+v", s)
	}
	if got := tb.Names(); !slices.Equal(got, []string{"a", "c", "d"}) {
		t.Fatalf("Names() = %v", got)
	}
	tb.Remove("nobody", func(*entry, int) { t.Error("drop called for an absent name") })
}

func TestCreateSeesCount(t *testing.T) {
	var tb Table[entry]
	tb.Init(10)
	for i := 1; i <= 3; i++ {
		tb.Add(fmt.Sprint(i), func(id uint16, n int) *entry {
			if n != i {
				t.Errorf("create told %d entries, want %d", n, i)
			}
			return &entry{id: id}
		})
	}
}

func TestConcurrentAddOneEntryPerName(t *testing.T) {
	var tb Table[entry]
	tb.Init(1 << 16)
	const names, workers = 200, 4
	got := make([][]*entry, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range names {
				got[w] = append(got[w], add(&tb, fmt.Sprint(i)))
			}
		}()
	}
	wg.Wait()
	for w := 1; w < workers; w++ {
		for i := range names {
			if got[w][i] != got[0][i] {
				t.Fatalf("name %d: two entries %p %p", i, got[w][i], got[0][i])
			}
		}
	}
	if s := tb.Load(); len(s.ByName) != names || len(s.ByID) != names {
		t.Fatalf("%d names, %d ids, want %d", len(s.ByName), len(s.ByID), names)
	}
}

func TestGetDoesNotAllocate(t *testing.T) {
	var tb Table[entry]
	tb.Init(4)
	add(&tb, "a")
	if n := testing.AllocsPerRun(100, func() { _ = tb.Get("a") }); n != 0 {
		t.Fatalf("Get allocates %v times", n)
	}
}
