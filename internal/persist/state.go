package persist

import (
	"context"
	"log/slog"

	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/store"
)

// StateSaver writes every registry state a view publishes, and the Consul
// indexes it was built from, to a store.
type StateSaver struct {
	st      store.Store
	view    registry.View
	indexes func() map[registry.ConsulSelector]uint64
	log     *slog.Logger
}

// NewStateSaver returns a saver of view's states into st. indexes, when
// not nil, returns the Consul blocking-query index reached for each
// selector (consul.Source.Indexes); they are saved with each state, so a
// restart resumes its queries where this run left them.
func NewStateSaver(st store.Store, view registry.View, indexes func() map[registry.ConsulSelector]uint64, logger *slog.Logger) *StateSaver {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &StateSaver{st: st, view: view, indexes: indexes, log: logger}
}

// Run saves each published state (version 0, the empty state before the
// first publish, is never saved) and waits for it to be durable before
// looking at the next one: a SIGKILL then loses at most the state published
// while that one commit ran (a few milliseconds), where the store's
// batched writer alone could lose up to its flush interval of states. It
// runs beside the registry, so a publish is never slowed down; states
// published while a commit runs are coalesced into the latest. A failed
// flush is logged and the state stays pending in the store, to be retried
// with its next flush. Run returns nil when ctx ends.
func (s *StateSaver) Run(ctx context.Context) error {
	var last uint64
	for {
		st, changed := s.view.Current()
		if st.Version != 0 && st.Version != last {
			s.st.SaveState(st)
			if s.indexes != nil {
				for sel, idx := range s.indexes() {
					s.st.SaveConsulIndex(consulIndexKey(sel), idx)
				}
			}
			if err := s.st.Flush(ctx); err != nil && ctx.Err() == nil {
				s.log.Error("store: persisting the registry state failed; it stays in memory and is retried with the next write", "version", st.Version, "err", err)
			}
			last = st.Version
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		}
	}
}
