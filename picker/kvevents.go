package picker

import "github.com/switchyard/switchyard/picker/kvevents"

// KVEvents returns the manager that follows the KV-cache events of the
// servers whose pool (or endpoint) declares them, while Run runs (nil
// otherwise). The kv-events stage (kvstage.go) turns each request of
// such a pool into a kvevents.Query, the exact cache view the prefix and
// TTFT scorers consult (sched.Request.Cache); pools and servers without
// events are left to the estimating prefix index.
func (s *Server) KVEvents() *kvevents.Manager { return s.kv.Load() }

// KVEventsStatus returns every followed stream's status (nil when Run is
// not running).
func (s *Server) KVEventsStatus() []kvevents.Status {
	if kv := s.kv.Load(); kv != nil {
		return kv.Status()
	}
	return nil
}

// kvOptions are the subscribers' options, logging with the picker.
func (s *Server) kvOptions() kvevents.Options {
	o := s.opts.KVEvents
	if o.Logger == nil {
		o.Logger = s.log.With("component", "kv-events")
	}
	return o
}

// kvBusy is how many requests the picker has in flight on a pool's
// endpoint: the tokenizer's background calls go to the least busy.
func (s *Server) kvBusy(pool, addr string) int {
	if e := s.snap.Load().pools[pool].lookup(addr); e != nil {
		return int(e.Load.InFlightRequests.Load())
	}
	return 0
}
