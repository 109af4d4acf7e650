package picker

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/switchyard/switchyard/picker/admission"
)

// The protocol adapter: Envoy's ext_proc messages, in every processing
// mode (NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED,
// observability mode, the mode override), fed through the request's
// stages (request.go), and their outcome turned into ext_proc responses.

type bodyMode = extprocfilterv3.ProcessingMode_BodySendMode

const (
	modeNone     = extprocfilterv3.ProcessingMode_NONE
	modeStreamed = extprocfilterv3.ProcessingMode_STREAMED
	modeBuffered = extprocfilterv3.ProcessingMode_BUFFERED
	modePartial  = extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL
	modeDuplex   = extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED
)

type sendFunc func(*extprocv3.ProcessingResponse) error

// stream is the state of one ext_proc stream, i.e. one HTTP request. It is
// owned by a single Process goroutine. It holds Envoy's protocol state
// and, embedded in the same allocation, the request it carries.
type stream struct {
	request

	modesKnown        bool
	reqMode, respMode bodyMode
	// bodyEarly: Envoy sends body chunks before the headers are answered
	// (always so in FULL_DUPLEX_STREAMED).
	bodyEarly bool

	trailers  bool
	decided   bool
	chunkLens []int // STREAMED mode: original chunk sizes
}

// newStream returns the state of a new ext_proc stream. Streams are
// pooled: the stages take the request by pointer through their hook
// interfaces, so it lives on the heap, and a request should not cost an
// allocation for it. Return it with freeStream.
func (s *Server) newStream(ctx context.Context) *stream {
	st := s.streams.Get().(*stream)
	st.s, st.ctx, st.ch = s, ctx, &s.snap.Load().chain
	st.reqMode, st.respMode = s.opts.RequestBodyMode, s.opts.ResponseBodyMode
	st.respBody = st.respMode != modeNone
	return st
}

// freeStream returns st to the pool once its stream has ended. Nothing
// holds a pointer into it then: responses are marshalled as they are
// sent, and what outlives the request (records, spans, prefill work) is
// allocated apart. Clearing it drops the request's references (its body)
// at once.
func (s *Server) freeStream(st *stream) {
	*st = stream{}
	s.streams.Put(st)
}

// handle processes one message; done means the stream is finished (an
// immediate response was sent).
func (st *stream) handle(req *extprocv3.ProcessingRequest, send sendFunc) (bool, error) {
	if !st.modesKnown {
		st.modesKnown = true
		st.bodyEarly = true
		if pc := req.GetProtocolConfig(); pc != nil {
			st.reqMode, st.respMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
			st.respBody = st.respMode != modeNone
			st.bodyEarly = pc.GetSendBodyWithoutWaitingForHeaderResponse()
		}
	}
	if req.GetObservabilityMode() {
		send = func(*extprocv3.ProcessingResponse) error { return nil }
	}
	switch v := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return st.onRequestHeaders(req.GetMetadataContext(), v.RequestHeaders, send)
	case *extprocv3.ProcessingRequest_RequestBody:
		return st.onRequestBody(v.RequestBody, send)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return st.onRequestTrailers(send)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return false, st.onResponseHeaders(req.GetMetadataContext(), v.ResponseHeaders, send)
	case *extprocv3.ProcessingRequest_ResponseBody:
		return false, st.onResponseBody(req.GetMetadataContext(), v.ResponseBody, send)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return false, st.onResponseTrailers(req.GetMetadataContext(), send)
	case nil:
		// Flow-control-only message: nothing to answer.
		return false, nil
	default:
		return false, status.Errorf(codes.InvalidArgument, "unexpected ext_proc request %T", v)
	}
}

func (st *stream) wrapSend(send sendFunc, r *extprocv3.ProcessingResponse) error {
	if err := send(r); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	return nil
}

func (st *stream) onRequestHeaders(md *corev3.Metadata, h *extprocv3.HttpHeaders, send sendFunc) (bool, error) {
	r := &st.request
	r.readHeaders(md, h)
	if rep := r.begin(); rep.code != 0 {
		return st.reject(rep, send)
	}
	if rep := r.checkLength(); rep.code != 0 {
		return st.reject(rep, send)
	}
	if h.GetEndOfStream() || st.reqMode == modeNone {
		r.headerOnly = true
		return st.decide(send)
	}
	if st.reqMode == modeBuffered || st.reqMode == modePartial {
		// Envoy buffers the body only after the headers are answered; the
		// destination goes into the body response's header mutation.
		cr := &extprocv3.CommonResponse{}
		if len(r.remove) > 0 {
			cr.HeaderMutation = &extprocv3.HeaderMutation{RemoveHeaders: r.remove}
		}
		return false, st.wrapSend(send, requestHeadersResponse(cr))
	}
	if st.reqMode == modeStreamed && !st.bodyEarly {
		// STREAMED mode would withhold the body until the headers are
		// answered, but the destination depends on the body: ask Envoy to
		// switch this request to FULL_DUPLEX_STREAMED (the one transition a
		// standalone mode_override allows; needs allow_mode_override).
		override := &extprocv3.ProcessingResponse{ModeOverride: &extprocfilterv3.ProcessingMode{
			RequestBodyMode:    modeDuplex,
			RequestTrailerMode: extprocfilterv3.ProcessingMode_SEND,
			ResponseBodyMode:   st.respMode,
		}}
		if err := st.wrapSend(send, override); err != nil {
			return false, err
		}
		st.reqMode = modeDuplex
	}
	// FULL_DUPLEX_STREAMED / STREAMED: hold the headers until the body is
	// complete.
	return false, nil
}

func (st *stream) onRequestBody(b *extprocv3.HttpBody, send sendFunc) (bool, error) {
	if st.decided {
		// Not expected (body after a header-only decision); pass it on.
		return false, st.passRequestBody(b, send)
	}
	data := b.GetBody()
	if rep := st.readBody(data); rep.code != 0 {
		return st.reject(rep, send)
	}
	if st.reqMode == modeStreamed {
		st.chunkLens = append(st.chunkLens, len(data))
	}
	if b.GetEndOfStream() || st.reqMode == modeBuffered || st.reqMode == modePartial {
		return st.decide(send)
	}
	return false, nil
}

func (st *stream) passRequestBody(b *extprocv3.HttpBody, send sendFunc) error {
	if st.reqMode == modeDuplex {
		return st.wrapSend(send, newStreamedChunk(true, b.GetBody(), b.GetEndOfStream()))
	}
	return st.wrapSend(send, requestBodyResponse(&extprocv3.CommonResponse{}))
}

func (st *stream) onRequestTrailers(send sendFunc) (bool, error) {
	if !st.decided {
		st.trailers = true
		if done, err := st.decide(send); done || err != nil {
			return done, err
		}
	}
	return false, st.wrapSend(send, requestTrailersResponse())
}

// reject sends a local reply and ends the stream.
func (st *stream) reject(rep reply, send sendFunc) (bool, error) {
	st.decided = true
	return true, st.wrapSend(send, st.localReply(rep))
}

// decide decides once the request is complete and releases the held
// request messages (answer.go), or answers it locally. A request the
// admission queue holds waits here; in modes where Envoy times the
// picker's answer (everything but a FULL_DUPLEX_STREAMED body), Envoy is
// first asked to wait longer.
func (st *stream) decide(send sendFunc) (bool, error) {
	st.decided = true
	r := &st.request
	if resp := r.answerModels(); resp != nil {
		return true, st.wrapSend(send, resp)
	}
	rep := r.decide()
	if rep.code == codeQueue {
		if st.reqMode != modeDuplex || r.headerOnly {
			wait := r.maxWait() + time.Second
			if err := st.wrapSend(send, &extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(wait)}); err != nil {
				return true, err
			}
		}
		var err error
		if rep, err = r.wait(); err != nil {
			if errors.Is(err, admission.ErrCancelled) {
				// Envoy or the client gave up: nobody reads an answer.
				return true, nil
			}
			return true, err
		}
	}
	if rep.code != 0 {
		return st.reject(rep, send)
	}
	return false, st.answer(send)
}

func (st *stream) onResponseHeaders(md *corev3.Metadata, h *extprocv3.HttpHeaders, send sendFunc) error {
	if err := st.wrapSend(send, st.responseHeaders(md, h)); err != nil {
		return err
	}
	if h.GetEndOfStream() {
		st.release()
	}
	return nil
}

func (st *stream) onResponseBody(md *corev3.Metadata, b *extprocv3.HttpBody, send sendFunc) error {
	st.responseBodyMessage(md, b)
	data, eos := b.GetBody(), b.GetEndOfStream()
	var r *extprocv3.ProcessingResponse
	switch st.respMode {
	case modeDuplex:
		out, _ := st.responseFilter(data, eos)
		if len(out) > 0 || eos {
			r = newStreamedChunk(false, out, eos)
		}
	case modeBuffered, modePartial:
		cr := &extprocv3.CommonResponse{}
		if out, changed := st.responseFilter(data, true); changed {
			cr.BodyMutation = replaceBody(out)
			cr.HeaderMutation = &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				setHeader("content-length", strconv.Itoa(len(out))),
			}}
		}
		r = responseBodyResponse(cr)
	default: // STREAMED: exactly one answer per chunk
		cr := &extprocv3.CommonResponse{}
		if out, changed := st.responseFilter(data, eos); changed {
			cr.BodyMutation = replaceBody(out)
		}
		r = responseBodyResponse(cr)
	}
	if r != nil {
		if err := st.wrapSend(send, r); err != nil {
			return err
		}
	}
	if eos {
		st.release()
	}
	return nil
}

func (st *stream) onResponseTrailers(md *corev3.Metadata, send sendFunc) error {
	st.recordServed(md)
	defer st.release()
	if st.respMode == modeDuplex {
		if out, _ := st.responseFilter(nil, true); len(out) > 0 {
			if err := st.wrapSend(send, newStreamedChunk(false, out, false)); err != nil {
				return err
			}
		}
	}
	return st.wrapSend(send, responseTrailersResponse())
}
