package picker

import (
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// The answer stage: the decision as Envoy takes it, in the response that
// releases the held request (its headers, or in BUFFERED modes its
// body): the destination header and the envoy.lb metadata, the pool
// header, the removal of the client's protocol (and key) headers, the
// stages' additions (answer hooks), and the body as it goes upstream, per
// processing mode. respond.go builds the messages.

// answer sends the decision and the request body that goes with it.
func (st *stream) answer(send sendFunc) error {
	r := &st.request
	var remove []string
	for _, k := range r.remove {
		if k != HeaderDestination && k != HeaderPool {
			remove = append(remove, k)
		}
	}
	body := r.upstream
	clen := len(body)
	if r.headerOnly {
		clen = -1
	}
	asBody := !r.headerOnly && (st.reqMode == modeBuffered || st.reqMode == modePartial)
	d := newDecision(r.dest, string(r.dest), r.pool.nameBytes, clen, remove, asBody)
	for _, h := range r.ch.answer {
		h.answer(r, d)
	}

	if r.headerOnly {
		return st.wrapSend(send, &d.pr)
	}
	switch st.reqMode {
	case modeBuffered, modePartial:
		if r.bodyRewritten {
			d.cr.BodyMutation = replaceBody(body)
		}
		return st.wrapSend(send, &d.pr)
	case modeStreamed:
		if err := st.wrapSend(send, &d.pr); err != nil {
			return err
		}
		// One answer per received chunk, the rewritten body laid over the
		// original chunk boundaries (the last chunk absorbs the size change).
		off := 0
		for i, n := range st.chunkLens {
			cr := &extprocv3.CommonResponse{}
			if r.bodyRewritten {
				lo, hi := min(off, len(body)), min(off+n, len(body))
				if i == len(st.chunkLens)-1 {
					hi = len(body)
				}
				cr.BodyMutation = replaceBody(body[lo:hi])
			}
			off += n
			if err := st.wrapSend(send, requestBodyResponse(cr)); err != nil {
				return err
			}
		}
		return nil
	default: // FULL_DUPLEX_STREAMED
		if err := st.wrapSend(send, &d.pr); err != nil {
			return err
		}
		chunk := r.s.opts.StreamChunkBytes
		for off := 0; ; off += chunk {
			end := min(off+chunk, len(body))
			last := end == len(body)
			if err := st.wrapSend(send, newStreamedChunk(true, body[off:end], last && !st.trailers)); err != nil {
				return err
			}
			if last {
				return nil
			}
		}
	}
}
