package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Publisher publishes KV-cache events the way vLLM 0.32's
// ZmqEventPublisher does: a PUB socket sends [topic, 8-byte big-endian
// sequence, payload] with sequences from 0, and a ROUTER socket answers a
// replay request (an empty delimiter and an 8-byte start sequence) with
// every buffered batch from that sequence on, each as ["", topic,
// sequence, payload], then the end marker ["", "", -1, ""]. The
// simulator (cmd/vllm-sim) publishes through it; tests use it as an
// engine.
type Publisher struct {
	opts   PublisherOptions
	pub    zmq4.Socket
	router zmq4.Socket
	cancel context.CancelFunc
	done   chan struct{}

	mu     sync.Mutex
	seq    int64
	buffer []replayed // ring of the last BufferSteps batches
	head   int        // index of the oldest entry once full
}

// PublisherOptions configure a Publisher.
type PublisherOptions struct {
	// Endpoint is where the PUB socket listens ("tcp://127.0.0.1:5557";
	// port 0 picks a free one); Replay where the ROUTER listens ("" none).
	Endpoint, Replay string
	// Topic prefixes every message ("" none).
	Topic string
	// Format is the payload encoding.
	Format Format
	// BufferSteps is how many batches replay can serve (default 10000,
	// as vLLM).
	BufferSteps int
	// DPRank is the data-parallel rank written into each batch.
	DPRank int
}

// NewPublisher binds the sockets.
func NewPublisher(opts PublisherOptions) (*Publisher, error) {
	if opts.BufferSteps <= 0 {
		opts.BufferSteps = 10000
	}
	ctx, cancel := context.WithCancel(context.Background())
	quiet := zmq4.WithLogger(log.New(io.Discard, "", 0))
	p := &Publisher{opts: opts, cancel: cancel, done: make(chan struct{})}
	p.pub = zmq4.NewPub(ctx, quiet)
	if err := p.pub.Listen(opts.Endpoint); err != nil {
		cancel()
		return nil, fmt.Errorf("kv events: listen %s: %w", opts.Endpoint, err)
	}
	if opts.Replay == "" {
		close(p.done)
		return p, nil
	}
	p.router = zmq4.NewRouter(ctx, quiet)
	if err := p.router.Listen(opts.Replay); err != nil {
		p.pub.Close()
		cancel()
		return nil, fmt.Errorf("kv events: listen %s: %w", opts.Replay, err)
	}
	go p.serveReplay()
	return p, nil
}

// Endpoint is the PUB socket's address ("tcp://ip:port").
func (p *Publisher) Endpoint() string { return "tcp://" + p.pub.Addr().String() }

// Replay is the ROUTER socket's address, "" without one.
func (p *Publisher) Replay() string {
	if p.router == nil {
		return ""
	}
	return "tcp://" + p.router.Addr().String()
}

// Port returns the port of an address Endpoint or Replay returned.
func Port(addr string) int {
	_, port, _ := net.SplitHostPort(addr[len("tcp://"):])
	var n int
	fmt.Sscan(port, &n)
	return n
}

// Publish sends one batch of events now and returns its sequence number.
func (p *Publisher) Publish(events []EncodeEvent) int64 { return p.publish(events, true) }

// PublishLost buffers a batch for replay without sending it, as if the
// network lost it: subscribers see a gap (tests).
func (p *Publisher) PublishLost(events []EncodeEvent) int64 { return p.publish(events, false) }

func (p *Publisher) publish(events []EncodeEvent, send bool) int64 {
	ts := float64(time.Now().UnixNano()) / 1e9
	payload := AppendBatch(nil, ts, p.opts.DPRank, events, p.opts.Format)
	p.mu.Lock()
	seq := p.seq
	p.seq++
	if len(p.buffer) < p.opts.BufferSteps {
		p.buffer = append(p.buffer, replayed{seq, payload})
	} else {
		p.buffer[p.head] = replayed{seq, payload}
		p.head = (p.head + 1) % len(p.buffer)
	}
	if send {
		// Sent under the lock so that sequences leave in order.
		_ = p.pub.Send(zmq4.NewMsgFrom([]byte(p.opts.Topic), binary.BigEndian.AppendUint64(nil, uint64(seq)), payload))
	}
	p.mu.Unlock()
	return seq
}

// Published is how many batches were published (the next sequence).
func (p *Publisher) Published() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seq
}

// from returns the buffered batches with sequence >= start, oldest first.
func (p *Publisher) from(start int64) []replayed {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []replayed
	for i := range p.buffer {
		b := p.buffer[(p.head+i)%len(p.buffer)]
		if b.seq >= start {
			out = append(out, b)
		}
	}
	return out
}

func (p *Publisher) serveReplay() {
	defer close(p.done)
	end := binary.BigEndian.AppendUint64(nil, endSeq)
	for {
		m, err := p.router.Recv()
		if err != nil {
			return // closed
		}
		// [identity, "", start]
		if len(m.Frames) != 3 || len(m.Frames[2]) != 8 {
			continue
		}
		id := m.Frames[0]
		start := int64(binary.BigEndian.Uint64(m.Frames[2]))
		for _, b := range p.from(start) {
			if err := p.router.Send(zmq4.NewMsgFrom(id, []byte{}, []byte(p.opts.Topic), binary.BigEndian.AppendUint64(nil, uint64(b.seq)), b.payload)); err != nil {
				break
			}
		}
		_ = p.router.Send(zmq4.NewMsgFrom(id, []byte{}, []byte{}, end, []byte{}))
	}
}

// Close closes the sockets.
func (p *Publisher) Close() error {
	p.cancel()
	err := p.pub.Close()
	if p.router != nil {
		err = errors.Join(err, p.router.Close())
	}
	<-p.done
	return err
}
