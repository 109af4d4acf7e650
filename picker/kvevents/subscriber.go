package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"log"
	"log/slog"
	"math"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Target is one server's event stream.
type Target struct {
	// Pool and Address name the server: its pool and the "ip:port" the
	// picker routes to (its name in the pool's Index).
	Pool    string
	Address string
	// Endpoint is the PUB socket ("tcp://ip:port"); Replay the replay
	// ROUTER socket ("" when the engine has none); Topic the subscription
	// prefix ("" every topic).
	Endpoint string
	Replay   string
	Topic    string
	// APIKey is the bearer token the pool's servers want ("" none): the
	// tokenizer sends it.
	APIKey string
}

// Options tune the subscribers. Zero fields take the defaults.
type Options struct {
	// DialTimeout bounds a connection attempt (default 2 s).
	DialTimeout time.Duration
	// MinBackoff and MaxBackoff bound the wait between reconnections
	// (100 ms doubling to 5 s).
	MinBackoff, MaxBackoff time.Duration
	// ReplayTimeout bounds one replay exchange (default 5 s).
	ReplayTimeout time.Duration
	// ProbeInterval is how long a stream may be silent before the replay
	// socket is asked whether anything was missed (an idle engine sends
	// nothing; a lost last message or a half-open connection would go
	// unnoticed). Default 5 s; negative disables probing.
	ProbeInterval time.Duration
	// ProbeFailures is how many probes in a row may fail before the
	// connection is dropped and redialled (default 3).
	ProbeFailures int
	// Warmup is how long a Partial view must follow its engine before it
	// is trusted as Synced (default 2 min): blocks the engine cached
	// before the view began and has not announced since are missing from
	// it until they are evicted; the estimating index stands in
	// meanwhile. Negative: a Partial view is never trusted.
	Warmup time.Duration
	// Logger receives connection changes (nil: discarded).
	Logger *slog.Logger
}

func (o *Options) setDefaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&o.DialTimeout, 2*time.Second)
	def(&o.MinBackoff, 100*time.Millisecond)
	def(&o.MaxBackoff, 5*time.Second)
	def(&o.ReplayTimeout, 5*time.Second)
	def(&o.ProbeInterval, 5*time.Second)
	def(&o.Warmup, 2*time.Minute)
	if o.ProbeFailures <= 0 {
		o.ProbeFailures = 3
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
}

// Status is one subscriber's state for status pages and metrics.
type Status struct {
	Target
	State State
	// Connected: the PUB socket is connected now.
	Connected bool
	// LastSeq is the sequence number of the last applied batch (-1 none).
	LastSeq int64
	// Counters since start.
	Connects, Gaps, Replays, Replayed, Lost, Restarts, DecodeErrors, Duplicates int64
	// LastMessage is when the stream last delivered a batch; LastError the
	// latest connection or replay problem ("" none).
	LastMessage time.Time
	LastError   string
	Server      ServerStats
}

// subscriber follows one server's events into its Server.
type subscriber struct {
	t    Target
	srv  *Server
	opts *Options
	log  *slog.Logger
	zlog *log.Logger

	// Owned by the run goroutine.
	lastSeq    int64
	lastDigest uint64
	batch      Batch
	// partialSince is when the view last became Partial.
	partialSince time.Time
	// trusted is the state to restore after a reconnection that loses
	// nothing (Synced or Partial).
	trusted State

	status atomic.Pointer[Status]
	st     Status // the run goroutine's working copy
}

var digestSeed = maphash.MakeSeed()

func newSubscriber(t Target, srv *Server, opts *Options) *subscriber {
	s := &subscriber{t: t, srv: srv, opts: opts, lastSeq: -1,
		log:  opts.Logger.With("pool", t.Pool, "endpoint", t.Address, "kv_events", t.Endpoint),
		zlog: log.New(io.Discard, "", 0)}
	s.st = Status{Target: t, LastSeq: -1}
	s.publish()
	return s
}

func (s *subscriber) publish() {
	st := s.st
	st.State = s.srv.State()
	st.LastSeq = s.lastSeq
	cp := st
	s.status.Store(&cp)
}

func (s *subscriber) setState(st State) {
	if st == Partial && s.srv.State() != Partial {
		s.partialSince = time.Now()
	}
	if st == Synced || st == Partial {
		s.trusted = st
	}
	s.srv.SetState(st)
	// Status reads the state live but the counters from the last
	// published copy: publish with every change, so that a state is
	// never shown beside the counters from before the events that led
	// to it (a view Partial with nothing lost yet).
	s.publish()
}

// run follows the stream until ctx ends, reconnecting with back-off.
func (s *subscriber) run(ctx context.Context) {
	backoff := s.opts.MinBackoff
	failing := false // warned about already: later failures log at debug
	for ctx.Err() == nil {
		start, connects := time.Now(), s.st.Connects
		err := s.session(ctx)
		if ctx.Err() != nil {
			return
		}
		s.srv.SetState(Disconnected)
		s.st.Connected = false
		if s.st.Connects != connects {
			failing = false
		}
		if err != nil {
			s.st.LastError = err.Error()
			if failing {
				s.log.Debug("KV events stream still down", "err", err)
			} else {
				s.log.Warn("KV events stream down; the estimating prefix index serves this endpoint until it is back", "err", err)
			}
			failing = true
		}
		s.publish()
		if time.Since(start) > 4*s.opts.MaxBackoff {
			backoff = s.opts.MinBackoff
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, s.opts.MaxBackoff)
	}
}

type recvd struct {
	msg zmq4.Msg
	err error
}

// session connects once and follows the stream until it fails.
func (s *subscriber) session(ctx context.Context) error {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// Reconnection is ours: zmq4's automatic reconnect redials from the
	// connection reaper concurrently with Close (a data race llm-d hit).
	sub := zmq4.NewSub(sctx, zmq4.WithDialerMaxRetries(0), zmq4.WithDialerTimeout(s.opts.DialTimeout), zmq4.WithLogger(s.zlog))
	if err := sub.SetOption(zmq4.OptionSubscribe, s.t.Topic); err != nil {
		sub.Close()
		return fmt.Errorf("subscribe: %w", err)
	}
	if err := sub.Dial(s.t.Endpoint); err != nil {
		sub.Close()
		return fmt.Errorf("dial %s: %w", s.t.Endpoint, err)
	}
	msgs := make(chan recvd, 64)
	done := make(chan struct{})
	defer func() { cancel(); sub.Close(); <-done }()
	go func() {
		defer close(done)
		for {
			m, err := sub.Recv()
			select {
			case msgs <- recvd{m, err}:
			case <-sctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	s.st.Connected = true
	s.st.Connects++
	s.log.Info("KV events stream connected")
	s.resync(sctx)
	s.publish()

	tick := time.Second
	for _, d := range []time.Duration{s.opts.ProbeInterval, s.opts.Warmup} {
		if d > 0 && d < tick {
			tick = max(d, 10*time.Millisecond)
		}
	}
	ticker := time.NewTicker(tick)
	defer ticker.Stop()
	probeFails := 0
	lastHeard := time.Now()
	for {
		select {
		case <-sctx.Done():
			return nil
		case r := <-msgs:
			if r.err != nil {
				return fmt.Errorf("receive: %w", r.err)
			}
			lastHeard = time.Now()
			s.handle(sctx, r.msg)
			s.publish()
		case now := <-ticker.C:
			if s.srv.State() == Partial && s.opts.Warmup >= 0 && now.Sub(s.partialSince) >= s.opts.Warmup {
				s.log.Info("KV events view trusted after warm-up", "warmup", s.opts.Warmup)
				s.setState(Synced)
				s.publish()
			}
			if s.t.Replay == "" || s.opts.ProbeInterval <= 0 || now.Sub(lastHeard) < s.opts.ProbeInterval {
				continue
			}
			lastHeard = now
			if err := s.probe(sctx); err != nil {
				probeFails++
				s.st.LastError = err.Error()
				if probeFails >= s.opts.ProbeFailures {
					return fmt.Errorf("%d replay probes failed, the last: %w", probeFails, err)
				}
			} else {
				probeFails = 0
			}
			s.publish()
		}
	}
}

// handle applies one live message.
func (s *subscriber) handle(ctx context.Context, m zmq4.Msg) {
	if len(m.Frames) != 3 || len(m.Frames[1]) != 8 {
		s.st.DecodeErrors++
		s.st.LastError = fmt.Sprintf("message of %d frames, want [topic, sequence, payload]", len(m.Frames))
		return
	}
	seq := int64(binary.BigEndian.Uint64(m.Frames[1]))
	payload := m.Frames[2]
	switch {
	case s.lastSeq >= 0 && seq <= s.lastSeq:
		s.st.Duplicates++ // already applied from a replay
		return
	case s.lastSeq < 0 && s.srv.State() == Connecting:
		// No replay told us where the view begins: the engine's first
		// batch begins its cache; any later one leaves it unknown.
		if seq == 0 {
			s.setState(Synced)
		} else {
			s.setState(Partial)
		}
	case seq > s.lastSeq+1:
		s.st.Gaps++
		s.fillGap(ctx, seq)
	}
	s.apply(seq, payload)
}

// apply decodes and applies one batch in sequence.
func (s *subscriber) apply(seq int64, payload []byte) {
	if _, err := DecodeBatch(payload, &s.batch); err != nil {
		// A batch that cannot be read is a batch lost.
		s.st.DecodeErrors++
		s.st.LastError = fmt.Sprintf("batch %d: %v", seq, err)
		s.lose()
	} else {
		s.srv.Apply(&s.batch, time.Now())
	}
	s.lastSeq = seq
	s.lastDigest = maphash.Bytes(digestSeed, payload)
	s.st.LastMessage = time.Now()
}

// lose records that events were lost beyond recovery: the view is
// cleared and stays Partial until it can be trusted again.
func (s *subscriber) lose() {
	s.st.Lost++
	s.srv.Clear()
	s.setState(Partial)
	s.partialSince = time.Now()
}

// fillGap replays the batches between the last applied one and seq.
func (s *subscriber) fillGap(ctx context.Context, seq int64) {
	if s.t.Replay == "" {
		s.st.LastError = fmt.Sprintf("missed batches %d-%d and no replay socket", s.lastSeq+1, seq-1)
		s.lose()
		return
	}
	want := s.lastSeq + 1
	got, err := s.replay(ctx, want)
	if err != nil {
		s.st.LastError = fmt.Sprintf("replay of batches %d-%d: %v", want, seq-1, err)
		s.lose()
		return
	}
	if len(got) == 0 || got[0].seq != want {
		s.st.LastError = fmt.Sprintf("batches %d-%d are no longer in the engine's replay buffer", want, seq-1)
		s.lose()
	}
	for _, b := range got {
		if b.seq >= seq {
			break
		}
		if b.seq > s.lastSeq {
			s.apply(b.seq, b.payload)
		}
	}
}

// resync runs on every (re)connection: it checks, through the replay
// socket, that the engine is the process whose batches were applied (a
// restarted engine begins its sequence anew with an empty cache) and
// catches up on what was published meanwhile; on a first connection it
// replays the engine's whole buffer.
func (s *subscriber) resync(ctx context.Context) {
	if s.t.Replay == "" {
		if s.lastSeq >= 0 {
			// Cannot tell a restarted engine from a blip: start over.
			s.srv.Clear()
			s.lastSeq = -1
		}
		s.setState(Connecting)
		return
	}
	if s.lastSeq >= 0 {
		got, err := s.replay(ctx, s.lastSeq)
		if err != nil {
			s.st.LastError = fmt.Sprintf("replay after reconnection: %v", err)
			s.srv.Clear()
			s.lastSeq = -1
			s.setState(Connecting)
			return
		}
		if len(got) > 0 && got[0].seq == s.lastSeq && maphash.Bytes(digestSeed, got[0].payload) == s.lastDigest {
			s.setState(s.trusted)
			for _, b := range got[1:] {
				s.apply(b.seq, b.payload)
			}
			return
		}
		s.st.Restarts++
		s.log.Info("KV events: engine restarted (its sequence began anew); its view is dropped", "last_seq", s.lastSeq)
		s.srv.Clear()
		s.lastSeq = -1
	}
	s.initial(ctx)
}

// initial builds the view from the engine's replay buffer.
func (s *subscriber) initial(ctx context.Context) {
	got, err := s.replay(ctx, 0)
	if err != nil {
		s.st.LastError = fmt.Sprintf("initial replay: %v", err)
		s.setState(Connecting) // the first live batch decides
		return
	}
	if len(got) == 0 || got[0].seq == 0 {
		// The buffer holds the engine's whole history: exact.
		s.setState(Synced)
	} else {
		s.setState(Partial)
	}
	for _, b := range got {
		s.apply(b.seq, b.payload)
	}
}

// probe asks the replay socket for everything from the last applied
// batch on: the engine must still have that batch as applied (or it
// restarted), and anything after it was missed.
func (s *subscriber) probe(ctx context.Context) error {
	if s.lastSeq < 0 {
		if s.srv.State() == Connecting {
			s.initial(ctx)
			return nil
		}
		// The view began with an empty buffer: anything there now was
		// missed.
		got, err := s.replay(ctx, 0)
		if err != nil {
			return fmt.Errorf("replay probe: %w", err)
		}
		if len(got) > 0 {
			s.st.Gaps++
			if got[0].seq != 0 {
				s.lose()
			}
		}
		for _, b := range got {
			s.apply(b.seq, b.payload)
		}
		return nil
	}
	got, err := s.replay(ctx, s.lastSeq)
	if err != nil {
		return fmt.Errorf("replay probe: %w", err)
	}
	if len(got) == 0 || got[0].seq != s.lastSeq || maphash.Bytes(digestSeed, got[0].payload) != s.lastDigest {
		if len(got) > 0 && got[0].seq > s.lastSeq {
			// Still the same engine, but the batch rolled out of its
			// buffer: what followed it is lost.
			s.st.Gaps++
			s.lose()
			for _, b := range got {
				s.apply(b.seq, b.payload)
			}
			return nil
		}
		s.st.Restarts++
		s.log.Info("KV events: engine restarted (probe); its view is dropped", "last_seq", s.lastSeq)
		s.srv.Clear()
		s.lastSeq = -1
		s.initial(ctx)
		return nil
	}
	if len(got) > 1 {
		s.st.Gaps++
	}
	for _, b := range got[1:] {
		s.apply(b.seq, b.payload)
	}
	return nil
}

// replayFrames reads one replay answer as a DEALER receives it: the
// empty delimiter, then [topic, sequence, payload] (vLLM 0.32; the end
// marker has an empty topic) or [sequence, payload] (earlier versions).
func replayFrames(frames [][]byte) (seq uint64, payload []byte, err error) {
	f := frames
	if len(f) > 0 && len(f[0]) == 0 {
		f = f[1:]
	}
	if len(f) == 3 {
		f = f[1:] // the topic
	}
	if len(f) != 2 || len(f[0]) != 8 {
		sizes := make([]int, len(frames))
		for i, fr := range frames {
			sizes[i] = len(fr)
		}
		return 0, nil, fmt.Errorf("replay answer of frames sized %v, want [\"\", topic, sequence, payload]", sizes)
	}
	return binary.BigEndian.Uint64(f[0]), f[1], nil
}

type replayed struct {
	seq     int64
	payload []byte
}

// endSeq is the replay socket's end-of-batches marker (-1).
const endSeq = math.MaxUint64

// replay asks the engine's replay socket for every buffered batch from
// sequence from on.
func (s *subscriber) replay(ctx context.Context, from int64) ([]replayed, error) {
	s.st.Replays++
	rctx, cancel := context.WithTimeout(ctx, s.opts.ReplayTimeout)
	defer cancel()
	d := zmq4.NewDealer(rctx, zmq4.WithDialerMaxRetries(0), zmq4.WithDialerTimeout(s.opts.DialTimeout), zmq4.WithLogger(s.zlog))
	defer d.Close()
	if err := d.Dial(s.t.Replay); err != nil {
		return nil, fmt.Errorf("dial %s: %w", s.t.Replay, err)
	}
	// A REQ-style envelope: an empty delimiter, then the start sequence.
	if err := d.SendMulti(zmq4.NewMsgFrom([]byte{}, binary.BigEndian.AppendUint64(nil, uint64(from)))); err != nil {
		return nil, fmt.Errorf("send: %w", err)
	}
	var out []replayed
	for {
		m, err := d.Recv()
		if err != nil {
			if rctx.Err() != nil {
				err = fmt.Errorf("no end of replay within %v (%d batches received)", s.opts.ReplayTimeout, len(out))
			}
			return nil, err
		}
		seq, payload, err := replayFrames(m.Frames)
		if err != nil {
			return nil, err
		}
		if seq == endSeq {
			s.st.Replayed += int64(len(out))
			return out, nil
		}
		if seq > math.MaxInt64 {
			return nil, errors.New("replay: bad sequence number")
		}
		out = append(out, replayed{seq: int64(seq), payload: payload})
	}
}
