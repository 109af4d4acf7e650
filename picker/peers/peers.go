// Package peers owns what switchyard replicas tell each other so that each
// routes as if it saw all the traffic: every pick (pool, endpoint,
// estimated prompt tokens, prefix-block hashes, session) and its end.
// Envoy spreads requests over the replicas, so each replica's own in-flight
// counts and prefix index would otherwise see only its share.
//
// Each replica opens one client stream to every other replica's picker
// port (the same gRPC server as ext_proc, so the same mutual TLS and SAN
// allowlist apply) and sends batches of its events; the receiving side
// hands them to an Applier (the picker), attributes them to the sender's
// stream, and releases every pick of a stream that ends, so a replica that
// dies takes its in-flight counts with it. A peer that cannot keep up
// (its queue is full) has its stream reset rather than fall out of step.
//
// A replica also answers the others' questions about itself (Ask): its
// replica ID, whether it is ready and the xDS versions it serves, so that
// a replica that restarts can tell whether it serves what the others
// serve before it reports itself ready, and so that every replica names
// the others by the ID they gave themselves (a static peers list only
// knows addresses).
//
// Messages are protobuf BytesValues carrying a compact binary encoding
// (wire.go), so the service needs no generated code.
package peers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// Applier is what a replica does with the others' events.
type Applier interface {
	// Picked applies another replica's pick: count it in flight on its
	// endpoint, learn its prefix blocks and session.
	Picked(from string, p Pick)
	// Released undoes the in-flight part of an earlier Picked: the
	// request ended, or the replica that picked it went away.
	Released(from string, p Pick)
}

// Options configure a Mesh. Zero values mean the defaults.
type Options struct {
	// Self names this replica in its hello (its replica ID).
	Self string
	// Address is this replica's picker address as the others know it;
	// it goes with every stream, so a receiver can tell which of its
	// peers the stream comes from ("" sends none).
	Address string
	// Report returns what this replica answers another that asks (Ask);
	// nil answers with Self only, not ready.
	Report func() Report
	// Credentials returns the transport credentials for dialling the
	// replica at addr (mutual TLS when the picker port uses it); nil
	// dials in plaintext.
	Credentials func(addr string) credentials.TransportCredentials
	// QueueLen bounds the events waiting for one peer (default 16384).
	QueueLen int
	// BatchMax bounds the events of one message (default 512).
	BatchMax int
	// MinBackoff and MaxBackoff bound reconnection delays (100 ms, 2 s).
	// A stream that stayed up for StableAfter (default 1 s) resets the
	// delay to MinBackoff, so a replica that restarts is reconnected to
	// within about MinBackoff however it fared before; a replica whose
	// own stream arrives (it started) is reconnected to at once.
	MinBackoff, MaxBackoff time.Duration
	StableAfter            time.Duration
	// Logger defaults to a discarding one.
	Logger *slog.Logger
}

func (o Options) withDefaults() Options {
	if o.QueueLen <= 0 {
		o.QueueLen = 16384
	}
	if o.BatchMax <= 0 {
		o.BatchMax = 512
	}
	if o.MinBackoff <= 0 {
		o.MinBackoff = 100 * time.Millisecond
	}
	if o.MaxBackoff < o.MinBackoff {
		o.MaxBackoff = max(2*time.Second, o.MinBackoff)
	}
	if o.StableAfter <= 0 {
		o.StableAfter = time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// Mesh sends this replica's events to the other replicas and applies
// theirs. Create it with New, Register it on the picker's gRPC server, and
// Run it; SetPeers names the others.
type Mesh struct {
	app  Applier
	opts Options
	log  *slog.Logger
	ids  atomic.Uint64

	mu       sync.RWMutex
	out      map[string]*outPeer // by address
	in       map[int64]*inStream // by stream number
	inSeq    int64
	peersSet chan struct{} // wakes Run on SetPeers
	want     []string
}

// New returns a Mesh applying other replicas' events to app.
func New(app Applier, o Options) *Mesh {
	o = o.withDefaults()
	return &Mesh{app: app, opts: o, log: o.Logger, out: map[string]*outPeer{}, in: map[int64]*inStream{},
		peersSet: make(chan struct{}, 1)}
}

// NextID returns an ID for a new Pick, unique within this process.
func (m *Mesh) NextID() uint64 { return m.ids.Add(1) }

// SetPeers names the other replicas by their picker address; streams to
// replicas no longer named end, new ones start (when Run runs).
func (m *Mesh) SetPeers(addrs []string) {
	addrs = slices.Sorted(slices.Values(addrs))
	addrs = slices.Compact(addrs)
	m.mu.Lock()
	m.want = addrs
	m.mu.Unlock()
	select {
	case m.peersSet <- struct{}{}:
	default:
	}
}

// Published sends p to every connected peer. It never blocks: a peer whose
// queue is full has its stream reset (it then forgets this replica's picks
// and learns the later ones).
func (m *Mesh) Published(p Pick) { m.broadcast(event{pick: p}) }

// Finished tells every connected peer that pick id ended.
func (m *Mesh) Finished(id uint64) { m.broadcast(event{pick: Pick{ID: id}, done: true}) }

func (m *Mesh) broadcast(e event) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	for _, o := range m.out {
		o.enqueue(e)
	}
}

// Run keeps a stream open to every peer SetPeers named until ctx ends.
func (m *Mesh) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	defer func() {
		m.mu.Lock()
		for _, o := range m.out {
			o.cancel()
		}
		m.mu.Unlock()
		wg.Wait()
	}()
	for {
		m.mu.Lock()
		want := map[string]bool{}
		for _, a := range m.want {
			want[a] = true
		}
		for addr, o := range m.out {
			if !want[addr] {
				o.cancel()
				delete(m.out, addr)
				m.log.Info("peers: replica gone from the configuration", "peer", addr)
			}
		}
		for addr := range want {
			if _, ok := m.out[addr]; ok {
				continue
			}
			pctx, cancel := context.WithCancel(ctx)
			o := &outPeer{m: m, addr: addr, cancel: cancel, queue: make(chan event, m.opts.QueueLen), reset: make(chan struct{}, 1),
				kick: make(chan struct{}, 1)}
			m.out[addr] = o
			wg.Add(1)
			go func() {
				defer wg.Done()
				o.run(pctx)
			}()
		}
		m.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case <-m.peersSet:
		}
	}
}

// outPeer is the sending side towards one other replica.
type outPeer struct {
	m      *Mesh
	addr   string
	cancel context.CancelFunc
	queue  chan event
	reset  chan struct{} // 1-buffered: the queue overflowed
	kick   chan struct{} // 1-buffered: reconnect now (the peer started)

	connected atomic.Bool
	sent      atomic.Uint64
	dropped   atomic.Uint64
	resets    atomic.Uint64

	// id is the replica ID the peer gave when asked ("" not known).
	id atomic.Pointer[string]
}

// enqueue queues e while the stream is up; on overflow it asks run to
// reset the stream. Called under Mesh.mu (read).
func (o *outPeer) enqueue(e event) {
	if !o.connected.Load() {
		return
	}
	select {
	case o.queue <- e:
	default:
		o.dropped.Add(1)
		select {
		case o.reset <- struct{}{}:
		default:
		}
	}
}

var streamDesc = grpc.StreamDesc{StreamName: "Publish", ClientStreams: true}

// method is the full gRPC method name of the stream.
const method = "/" + ServiceName + "/Publish"

// ServiceName is the gRPC service replicas serve each other on their
// picker port.
const ServiceName = "switchyard.peers.v1.Peers"

func (o *outPeer) run(ctx context.Context) {
	backoff := time.Duration(0)
	for ctx.Err() == nil {
		up, err := o.stream(ctx)
		o.connected.Store(false)
		if ctx.Err() != nil {
			return
		}
		if up >= o.m.opts.StableAfter {
			// A good stream: whatever failed before it is history.
			backoff = 0
		}
		backoff = min(max(2*backoff, o.m.opts.MinBackoff), o.m.opts.MaxBackoff)
		o.m.log.Debug("peers: stream to replica ended; reconnecting", "peer", o.addr, "err", err, "in", backoff)
		t := time.NewTimer(time.Duration(float64(backoff) * (0.8 + 0.4*rand.Float64())))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-o.kick:
			t.Stop()
			o.m.log.Debug("peers: replica is back; reconnecting now", "peer", o.addr)
		case <-t.C:
		}
	}
}

// wake cuts a reconnection delay short: the peer just opened its own
// stream to this replica, so it is up.
func (o *outPeer) wake() {
	if o.connected.Load() {
		return
	}
	select {
	case o.kick <- struct{}{}:
	default:
	}
}

// stream runs one stream to the peer until it fails, ctx ends or the
// queue overflows; up is how long it was connected.
func (o *outPeer) stream(ctx context.Context) (up time.Duration, err error) {
	conn, err := o.m.dial(o.addr)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if a := o.m.opts.Address; a != "" {
		sctx = metadata.AppendToOutgoingContext(sctx, addressKey, a)
	}
	cs, err := conn.NewStream(sctx, &streamDesc, method)
	if err != nil {
		return 0, fmt.Errorf("open stream: %w", err)
	}
	if err := cs.SendMsg(&wrapperspb.BytesValue{Value: encodeHello(o.m.opts.Self)}); err != nil {
		return 0, fmt.Errorf("hello: %w", err)
	}
	// Learn the peer's name on the side, on the same connection: a peer
	// that does not answer (an older one) stays known by its address.
	go func() {
		actx, cancel := context.WithTimeout(sctx, askTimeout)
		defer cancel()
		if r, err := ask(actx, conn); err == nil && r.ID != "" {
			o.id.Store(&r.ID)
		}
	}()
	// The peer never answers on this stream; a receive returns only when
	// the stream ends (the peer died, restarted or closed it), which an
	// idle stream would otherwise notice only at its next send.
	ended := make(chan error, 1)
	go func() { ended <- cs.RecvMsg(&wrapperspb.BytesValue{}) }()
	start := time.Now()
	defer func() { up = time.Since(start) }()
	// Events queued before a reset belong to the stream the receiver has
	// forgotten; start clean.
	for len(o.queue) > 0 {
		<-o.queue
	}
	select {
	case <-o.reset:
	default:
	}
	o.connected.Store(true)
	o.m.log.Info("peers: sharing picks with replica", "peer", o.addr)
	batch := make([]event, 0, o.m.opts.BatchMax)
	var buf []byte
	for {
		select {
		case <-ctx.Done():
			_ = cs.CloseSend()
			return 0, ctx.Err()
		case <-o.reset:
			o.resets.Add(1)
			return 0, errors.New("queue overflow: the replica could not keep up")
		case err := <-ended:
			return 0, fmt.Errorf("stream ended by the replica: %w", err)
		case e := <-o.queue:
			batch = append(batch[:0], e)
		}
	drain:
		for len(batch) < o.m.opts.BatchMax {
			select {
			case e := <-o.queue:
				batch = append(batch, e)
			default:
				break drain
			}
		}
		buf = encodeBatch(buf[:0], time.Now(), batch)
		if err := cs.SendMsg(&wrapperspb.BytesValue{Value: buf}); err != nil {
			return 0, fmt.Errorf("send: %w", err)
		}
		o.sent.Add(uint64(len(batch)))
	}
}

// dial returns a client connection to the replica at addr, with the
// transport credentials Options.Credentials gives (it connects lazily).
func (m *Mesh) dial(addr string) (*grpc.ClientConn, error) {
	creds := insecure.NewCredentials()
	if c := m.opts.Credentials; c != nil {
		creds = c(addr)
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, fmt.Errorf("dial: %w", err)
	}
	return conn, nil
}

// addressKey is the stream metadata carrying the sender's picker address.
const addressKey = "switchyard-replica-address"

// askTimeout bounds the question a new stream asks its peer.
const askTimeout = 2 * time.Second

// reportMethod is the full gRPC method name of Ask.
const reportMethod = "/" + ServiceName + "/Report"

// Report is what a replica says about itself when another asks.
type Report struct {
	// ID is its replica ID (Options.Self).
	ID string
	// Ready is whether it reports itself ready (serving what it should).
	Ready bool
	// Versions are the xDS versions it serves, by resource type.
	Versions map[string]string
}

// Ask asks the replica at addr for its Report. A replica too old to
// answer fails with codes.Unimplemented.
func (m *Mesh) Ask(ctx context.Context, addr string) (Report, error) {
	conn, err := m.dial(addr)
	if err != nil {
		return Report{}, err
	}
	defer conn.Close()
	return ask(ctx, conn)
}

func ask(ctx context.Context, conn *grpc.ClientConn) (Report, error) {
	out := &wrapperspb.BytesValue{}
	if err := conn.Invoke(ctx, reportMethod, &wrapperspb.BytesValue{}, out); err != nil {
		return Report{}, err
	}
	return decodeReport(out.GetValue())
}

// report answers Ask.
func (m *Mesh) report() *wrapperspb.BytesValue {
	r := Report{ID: m.opts.Self}
	if m.opts.Report != nil {
		r = m.opts.Report()
	}
	return &wrapperspb.BytesValue{Value: encodeReport(r)}
}

// inStream is the receiving side of one stream from another replica.
type inStream struct {
	from     string
	address  string // the sender's picker address ("" not sent)
	received atomic.Uint64
	open     atomic.Int64
	lagNanos atomic.Int64 // the latest batch's age when it arrived
}

// Register adds the peers service to g (the picker's gRPC server).
func (m *Mesh) Register(g *grpc.Server) {
	g.RegisterService(&grpc.ServiceDesc{
		ServiceName: ServiceName,
		HandlerType: (*receiver)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "Report",
			Handler: func(srv any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				if err := dec(&wrapperspb.BytesValue{}); err != nil {
					return nil, err
				}
				return srv.(receiver).report(), nil
			},
		}},
		Streams: []grpc.StreamDesc{{
			StreamName:    "Publish",
			ClientStreams: true,
			Handler:       func(srv any, ss grpc.ServerStream) error { return srv.(receiver).receive(ss) },
		}},
		Metadata: "switchyard/picker/peers",
	}, m)
}

// receiver is the handler type the service is registered with.
type receiver interface {
	receive(grpc.ServerStream) error
	report() *wrapperspb.BytesValue
}

func (m *Mesh) receive(ss grpc.ServerStream) error {
	msg := &wrapperspb.BytesValue{}
	if err := ss.RecvMsg(msg); err != nil {
		return err
	}
	from, err := decodeHello(msg.GetValue())
	if err != nil {
		return err
	}
	st := &inStream{from: from}
	if md, ok := metadata.FromIncomingContext(ss.Context()); ok {
		if v := md.Get(addressKey); len(v) > 0 {
			st.address = v[0]
		}
	}
	m.mu.Lock()
	m.inSeq++
	id := m.inSeq
	m.in[id] = st
	// The sender is up: if the stream towards it waits to reconnect, it
	// need not.
	if o, ok := m.out[st.address]; ok {
		o.wake()
	}
	m.mu.Unlock()
	open := map[uint64]Pick{}
	defer func() {
		for _, p := range open {
			m.app.Released(from, p)
		}
		m.mu.Lock()
		delete(m.in, id)
		m.mu.Unlock()
		m.log.Info("peers: replica stream ended; its picks released", "peer", from, "released", len(open))
	}()
	m.log.Info("peers: replica sharing its picks", "peer", from)
	var evs []event
	for {
		msg.Value = nil
		if err := ss.RecvMsg(msg); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		var sent time.Time
		sent, evs, err = decodeBatch(msg.GetValue(), evs[:0])
		if err != nil {
			return err
		}
		st.lagNanos.Store(int64(time.Since(sent)))
		for _, e := range evs {
			if e.done {
				if p, ok := open[e.pick.ID]; ok {
					delete(open, e.pick.ID)
					m.app.Released(from, p)
				}
				continue
			}
			if _, dup := open[e.pick.ID]; dup {
				continue
			}
			open[e.pick.ID] = e.pick
			m.app.Picked(from, e.pick)
		}
		st.received.Add(uint64(len(evs)))
		st.open.Store(int64(len(open)))
	}
}

// PeerStats describes the stream to one other replica.
type PeerStats struct {
	Address string
	// ID is the replica ID the peer gave when asked ("" not known yet).
	ID        string
	Connected bool
	// Sent counts events sent; Dropped events that found the queue full;
	// Resets the streams reset because of that.
	Sent, Dropped, Resets uint64
}

// InboundStats describes one stream from another replica.
type InboundStats struct {
	// From is the replica ID the sender gave, Address its picker address
	// ("" from a replica that does not send it).
	From, Address string
	// Received counts events; Open is the picks not ended yet.
	Received uint64
	Open     int64
	// Lag is how old the latest batch was when it arrived (clocks of
	// both hosts).
	Lag time.Duration
}

// Stats is a snapshot of the mesh for the status page and metrics.
type Stats struct {
	Peers   []PeerStats    // sorted by Address
	Inbound []InboundStats // sorted by From
}

// Stats returns the mesh's counters.
func (m *Mesh) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	var s Stats
	for _, addr := range slices.Sorted(maps.Keys(m.out)) {
		o := m.out[addr]
		ps := PeerStats{Address: addr, Connected: o.connected.Load(),
			Sent: o.sent.Load(), Dropped: o.dropped.Load(), Resets: o.resets.Load()}
		if id := o.id.Load(); id != nil {
			ps.ID = *id
		}
		s.Peers = append(s.Peers, ps)
	}
	for _, st := range m.in {
		s.Inbound = append(s.Inbound, InboundStats{From: st.from, Address: st.address, Received: st.received.Load(),
			Open: st.open.Load(), Lag: time.Duration(st.lagNanos.Load())})
	}
	sort.Slice(s.Inbound, func(i, j int) bool { return s.Inbound[i].From < s.Inbound[j].From })
	return s
}
