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
// Replicas also share their metrics scrapes (when the Applier is a
// ReadingApplier and Options.NoReadings is not set): a replica streams
// the readings of the endpoints it reads for the others, and tells on
// every stream, again every HeartbeatInterval, that it does (its view).
// Sharers lists the replicas each endpoint's reading may be left to:
// those that this replica streams to and that stream to it, whose
// latest view says they read for the others and came within DeadAfter.
// Which replica reads which endpoint is picker/metrics' (rendezvous
// order over this replica and its sharers).
//
// Messages are protobuf BytesValues carrying a compact binary encoding
// (wire.go), so the service needs no generated code. Views and readings
// are sent only to replicas whose Report announces FeatureReadings: a
// replica too old to know them keeps getting picks, is sent no reading,
// and counts as no sharer (it reads every endpoint itself, as before).
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
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
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

// ReadingApplier is an Applier that also shares metrics readings.
type ReadingApplier interface {
	Applier
	// Reading applies a reading another replica made (and sent this
	// one: it reads the endpoint for it, or stands in).
	Reading(from string, r Reading)
	// Readings returns the latest readings this replica made of the
	// endpoints it reads, sent to a replica as soon as it takes them.
	Readings() []Reading
}

// Sharer is another replica that shares its readings with this one.
type Sharer struct {
	// ID is the replica ID it gave; Address its picker address as this
	// replica dials it.
	ID, Address string
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
	// NoReadings turns scrape sharing off: no view or reading is sent or
	// taken, and Report announces no FeatureReadings (every replica then
	// reads every endpoint itself).
	NoReadings bool
	// HeartbeatInterval is how often a view goes out on each stream that
	// takes them (default 250 ms); a replica whose stream to this one
	// brought nothing for DeadAfter (default 1 s) is no sharer until it
	// does again (it stalled, or its host went away without closing the
	// connection).
	HeartbeatInterval, DeadAfter time.Duration
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
	if o.HeartbeatInterval <= 0 {
		o.HeartbeatInterval = 250 * time.Millisecond
	}
	if o.DeadAfter <= 0 {
		o.DeadAfter = max(time.Second, 2*o.HeartbeatInterval)
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
	rapp ReadingApplier // nil: no scrape sharing
	opts Options
	log  *slog.Logger
	ids  atomic.Uint64
	// reads is set while this replica reads endpoints for the others
	// (SetSharing).
	reads atomic.Bool

	mu       sync.RWMutex
	out      map[string]*outPeer // by address
	in       map[int64]*inStream // by stream number
	inSeq    int64
	peersSet chan struct{} // wakes Run on SetPeers
	want     []string
	// sharers is the latest Sharers list, sharersCh closed when it
	// changes.
	sharers   []Sharer
	sharersCh chan struct{}
}

// New returns a Mesh applying other replicas' events to app. It shares
// scrapes when app is a ReadingApplier and o.NoReadings is not set.
func New(app Applier, o Options) *Mesh {
	o = o.withDefaults()
	m := &Mesh{app: app, opts: o, log: o.Logger, out: map[string]*outPeer{}, in: map[int64]*inStream{},
		peersSet: make(chan struct{}, 1), sharersCh: make(chan struct{})}
	if ra, ok := app.(ReadingApplier); ok && !o.NoReadings {
		m.rapp = ra
	}
	return m
}

// Self returns this replica's ID (Options.Self).
func (m *Mesh) Self() string { return m.opts.Self }

// Address returns this replica's picker address (Options.Address).
func (m *Mesh) Address() string { return m.opts.Address }

// SharesReadings reports whether this mesh shares scrapes at all.
func (m *Mesh) SharesReadings() bool { return m.rapp != nil }

// SetSharing says whether this replica reads endpoints for the others
// now (its metrics scraper runs); the others learn it at once.
func (m *Mesh) SetSharing(on bool) {
	if m.rapp == nil || m.reads.Swap(on) == on {
		return
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	for _, o := range m.out {
		o.poke()
	}
}

// PublishReading sends r to every connected peer that takes readings,
// without blocking (as Published).
func (m *Mesh) PublishReading(r Reading) {
	if m.rapp == nil {
		return
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	for _, o := range m.out {
		if o.readings.Load() {
			o.enqueue(event{reading: &r})
		}
	}
}

// Sharers returns the other replicas that share readings with this one
// now (sorted by ID), and a channel closed when that changes.
func (m *Mesh) Sharers() ([]Sharer, <-chan struct{}) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.sharers, m.sharersCh
}

// refreshSharers works Sharers out again, and tells its watchers when
// it changed.
func (m *Mesh) refreshSharers() {
	if m.rapp == nil {
		return
	}
	now := time.Now().UnixNano()
	m.mu.Lock()
	defer m.mu.Unlock()
	var next []Sharer
	for _, o := range m.out {
		id := o.id.Load()
		if id == nil || !o.connected.Load() || !o.readings.Load() {
			continue
		}
		for _, st := range m.in {
			if st.from == *id && st.reads.Load() && now-st.heard.Load() <= int64(m.opts.DeadAfter) {
				next = append(next, Sharer{ID: *id, Address: o.addr})
				break
			}
		}
	}
	sort.Slice(next, func(i, j int) bool { return next[i].ID < next[j].ID })
	if slices.Equal(next, m.sharers) {
		return
	}
	m.log.Info("peers: replicas sharing scrapes", "replicas", sharerIDs(next))
	m.sharers = next
	close(m.sharersCh)
	m.sharersCh = make(chan struct{})
}

func sharerIDs(ss []Sharer) []string {
	ids := make([]string, len(ss))
	for i, s := range ss {
		ids[i] = s.ID
	}
	return ids
}

// view is this replica's view for its streams.
func (m *Mesh) view() *shareView {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return &shareView{reads: m.reads.Load(), live: sharerIDs(m.sharers)}
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
	expire := time.NewTicker(m.opts.HeartbeatInterval)
	defer expire.Stop()
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
				kick: make(chan struct{}, 1), viewKick: make(chan struct{}, 1)}
			m.out[addr] = o
			wg.Add(1)
			go func() {
				defer wg.Done()
				o.run(pctx)
			}()
		}
		m.mu.Unlock()
		m.refreshSharers()
		select {
		case <-ctx.Done():
			return nil
		case <-m.peersSet:
		case <-expire.C:
			// A sharer whose stream went quiet is one no longer.
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
	// viewKick (1-buffered) sends this replica's view now.
	viewKick chan struct{}

	connected atomic.Bool
	// readings is set while the stream is up and the peer takes views
	// and readings.
	readings     atomic.Bool
	sent         atomic.Uint64
	readingsSent atomic.Uint64
	dropped      atomic.Uint64
	resets       atomic.Uint64

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

// poke asks the stream to send this replica's view now.
func (o *outPeer) poke() {
	select {
	case o.viewKick <- struct{}{}:
	default:
	}
}

func (o *outPeer) run(ctx context.Context) {
	backoff := time.Duration(0)
	for ctx.Err() == nil {
		up, err := o.stream(ctx)
		o.readings.Store(false)
		o.connected.Store(false)
		o.m.refreshSharers()
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
	// Learn the peer's name and whether it takes readings on the side,
	// on the same connection: a peer that does not answer (an older one)
	// stays known by its address, and gets picks only. A failed question
	// is asked again while the stream lasts.
	takes := make(chan struct{}, 1) // the peer's report announced FeatureReadings
	go func() {
		for wait := time.Duration(0); ; wait = min(2*wait+100*time.Millisecond, askTimeout) {
			select {
			case <-sctx.Done():
				return
			case <-time.After(wait):
			}
			actx, cancel := context.WithTimeout(sctx, askTimeout)
			r, err := ask(actx, conn)
			cancel()
			if status.Code(err) == codes.Unimplemented {
				return
			}
			if err != nil {
				continue
			}
			if r.ID != "" {
				o.id.Store(&r.ID)
			}
			if r.Features&FeatureReadings != 0 && o.m.rapp != nil {
				takes <- struct{}{}
			}
			o.m.refreshSharers()
			return
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
	heartbeat := time.NewTicker(o.m.opts.HeartbeatInterval)
	defer heartbeat.Stop()
	send := func(evs []event) error {
		buf = encodeBatch(buf[:0], time.Now(), evs)
		if err := cs.SendMsg(&wrapperspb.BytesValue{Value: buf}); err != nil {
			return fmt.Errorf("send: %w", err)
		}
		return nil
	}
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
		case <-takes:
			// The peer takes readings: say what this replica does, and
			// send the latest readings of what it reads, so the peer need
			// not wait for each endpoint's next scrape.
			o.readings.Store(true)
			o.m.log.Info("peers: sharing scrapes with replica", "peer", o.addr)
			evs := []event{{view: o.m.view()}}
			for _, r := range o.m.rapp.Readings() {
				evs = append(evs, event{reading: &r})
			}
			for len(evs) > 0 {
				n := min(len(evs), o.m.opts.BatchMax)
				if err := send(evs[:n]); err != nil {
					return 0, err
				}
				o.readingsSent.Add(uint64(n - 1))
				evs = evs[n:]
			}
			o.m.refreshSharers()
			continue
		case <-heartbeat.C:
			if !o.readings.Load() {
				continue
			}
			batch = append(batch[:0], event{view: o.m.view()})
		case <-o.viewKick:
			if !o.readings.Load() {
				continue
			}
			batch = append(batch[:0], event{view: o.m.view()})
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
		if err := send(batch); err != nil {
			return 0, err
		}
		var picks, readings uint64
		for _, e := range batch {
			switch {
			case e.reading != nil:
				readings++
			case e.view == nil:
				picks++
			}
		}
		o.sent.Add(picks)
		o.readingsSent.Add(readings)
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
	// Features are what its streams take besides picks
	// (FeatureReadings); set by the Mesh that answers, from its options.
	Features uint64
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
	r.Features = 0
	if m.rapp != nil {
		r.Features |= FeatureReadings
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
	// heard is when the latest batch arrived (unix nanos); reads whether
	// the sender's latest view says it reads endpoints for the others,
	// view (guarded by Mesh.mu) which replicas it shares readings with.
	heard    atomic.Int64
	reads    atomic.Bool
	view     []string
	readings atomic.Uint64
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
	st.heard.Store(time.Now().UnixNano())
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
		m.refreshSharers()
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
		arrived := time.Now()
		sent, evs, err = decodeBatchAt(msg.GetValue(), evs[:0], arrived)
		if err != nil {
			return err
		}
		st.lagNanos.Store(int64(arrived.Sub(sent)))
		wasQuiet := arrived.UnixNano()-st.heard.Swap(arrived.UnixNano()) > int64(m.opts.DeadAfter)
		picks := 0
		for _, e := range evs {
			if m.rapp == nil && (e.view != nil || e.reading != nil) {
				// What a replica that does not share scrapes makes of
				// them (an older one cannot decode them): the sender did
				// not ask first.
				return errors.New("peers: view or reading sent to a replica that takes none")
			}
			switch {
			case e.view != nil:
				m.mu.Lock()
				st.view = e.view.live
				m.mu.Unlock()
				if st.reads.Swap(e.view.reads) != e.view.reads {
					m.refreshSharers()
				}
				continue
			case e.reading != nil:
				st.readings.Add(1)
				m.rapp.Reading(from, *e.reading)
				continue
			}
			picks++
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
		st.received.Add(uint64(picks))
		st.open.Store(int64(len(open)))
		if wasQuiet {
			// A sharer that went quiet is heard again.
			m.refreshSharers()
		}
	}
}

// PeerStats describes the stream to one other replica.
type PeerStats struct {
	Address string
	// ID is the replica ID the peer gave when asked ("" not known yet).
	ID        string
	Connected bool
	// Readings is set while the stream takes views and readings.
	Readings bool
	// Sent counts pick events sent; ReadingsSent readings; Dropped
	// events that found the queue full; Resets the streams reset because
	// of that.
	Sent, ReadingsSent, Dropped, Resets uint64
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
	// both hosts); Quiet how long ago it arrived.
	Lag, Quiet time.Duration
	// Reads says the sender's latest view said it reads endpoints for
	// the others; View lists the replicas it shares readings with
	// (itself not included); Readings counts the readings it sent.
	Reads    bool
	View     []string
	Readings uint64
}

// Stats is a snapshot of the mesh for the status page and metrics.
type Stats struct {
	Peers   []PeerStats    // sorted by Address
	Inbound []InboundStats // sorted by From
	// Sharers are the replicas sharing readings with this one (Sharers).
	Sharers []Sharer
}

// Stats returns the mesh's counters.
func (m *Mesh) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	var s Stats
	for _, addr := range slices.Sorted(maps.Keys(m.out)) {
		o := m.out[addr]
		ps := PeerStats{Address: addr, Connected: o.connected.Load(), Readings: o.readings.Load(),
			Sent: o.sent.Load(), ReadingsSent: o.readingsSent.Load(), Dropped: o.dropped.Load(), Resets: o.resets.Load()}
		if id := o.id.Load(); id != nil {
			ps.ID = *id
		}
		s.Peers = append(s.Peers, ps)
	}
	now := time.Now().UnixNano()
	for _, st := range m.in {
		s.Inbound = append(s.Inbound, InboundStats{From: st.from, Address: st.address, Received: st.received.Load(),
			Open: st.open.Load(), Lag: time.Duration(st.lagNanos.Load()), Quiet: time.Duration(now - st.heard.Load()),
			Reads: st.reads.Load(), View: slices.Clone(st.view), Readings: st.readings.Load()})
	}
	s.Sharers = slices.Clone(m.sharers)
	sort.Slice(s.Inbound, func(i, j int) bool { return s.Inbound[i].From < s.Inbound[j].From })
	return s
}
