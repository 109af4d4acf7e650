package picker

import (
	"encoding/json"
	"strconv"

	"github.com/switchyard/switchyard/internal/contract"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// Wire names of the Endpoint Picker Protocol (defined in internal/contract).
const (
	HeaderDestination       = contract.DestinationHeader
	HeaderDestinationSubset = contract.SubsetHeader
	HeaderDestinationServed = contract.ServedHeader
	HeaderPool              = contract.PoolHeader
	MetadataNamespace       = contract.LBNamespace
	SubsetNamespace         = contract.SubsetHintNamespace
	MetadataDestination     = contract.DestinationKey
	MetadataServed          = contract.ServedKey
	MetadataSubset          = contract.SubsetKey
)

// rejectCodes indexes counters.rejected.
var rejectCodes = [...]int{400, 401, 403, 404, 413, 429, 503, 500}

func rejectIndex(code int) int {
	for i, c := range rejectCodes {
		if c == code {
			return i
		}
	}
	return len(rejectCodes) - 1
}

// errorType maps a local-reply status onto an OpenAI-style error type.
func errorType(code int) string {
	switch code {
	case 400:
		return "invalid_request_error"
	case 401:
		return "authentication_error"
	case 403:
		return "permission_error"
	case 404:
		return "not_found_error"
	case 413:
		return "request_too_large"
	case 429:
		return "rate_limit_exceeded"
	case 503:
		return "service_unavailable"
	}
	return "internal_error"
}

type errorBody struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    int    `json:"code"`
	} `json:"error"`
}

// immediate builds a local reply with an OpenAI-style JSON error body.
func immediate(code int, msg string) *extprocv3.ProcessingResponse {
	var eb errorBody
	eb.Error.Message, eb.Error.Type, eb.Error.Code = msg, errorType(code), code
	body, _ := json.Marshal(&eb)
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ImmediateResponse{
			ImmediateResponse: &extprocv3.ImmediateResponse{
				Status: &typev3.HttpStatus{Code: typev3.StatusCode(code)},
				Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
					setHeader("content-type", "application/json"),
				}},
				Body:    body,
				Details: "switchyard_picker_" + errorType(code),
			},
		},
	}
}

func setHeader(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{
		Header:       &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
	}
}

func requestHeadersResponse(cr *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: cr},
	}}
}

func requestBodyResponse(cr *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: cr},
	}}
}

func responseBodyResponse(cr *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
		ResponseBody: &extprocv3.BodyResponse{Response: cr},
	}}
}

// replaceBody is a BodyMutation for STREAMED/BUFFERED modes.
func replaceBody(b []byte) *extprocv3.BodyMutation {
	if len(b) == 0 {
		return &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_ClearBody{ClearBody: true}}
	}
	return &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: b}}
}

func requestTrailersResponse() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
		RequestTrailers: &extprocv3.TrailersResponse{},
	}}
}

func responseTrailersResponse() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
		ResponseTrailers: &extprocv3.TrailersResponse{},
	}}
}

// headerValue reads a header's value from Envoy's HeaderValue (raw_value
// preferred, value as a fallback).
func headerValue(h *corev3.HeaderValue) string {
	if len(h.RawValue) > 0 {
		return string(h.RawValue)
	}
	return h.Value
}

// metadataString reads filter_metadata[ns][key] as a string; a list value is
// joined with commas.
func metadataFields(md *corev3.Metadata, ns string) map[string]*structpb.Value {
	if md == nil {
		return nil
	}
	return md.GetFilterMetadata()[ns].GetFields()
}

// decisionBlock holds every message of a routing decision in one
// allocation: the request headers (or buffered body) response with its
// header mutation and the envoy.lb dynamic metadata. Fields are wired by
// pointer and never copied.
type decisionBlock struct {
	pr      extprocv3.ProcessingResponse
	hdrs    extprocv3.ProcessingResponse_RequestHeaders
	body    extprocv3.ProcessingResponse_RequestBody
	hr      extprocv3.HeadersResponse
	br      extprocv3.BodyResponse
	cr      extprocv3.CommonResponse
	hm      extprocv3.HeaderMutation
	setPtrs [5]*corev3.HeaderValueOption // room for stages' headers (answer hooks)
	set     [3]corev3.HeaderValueOption
	vals    [3]corev3.HeaderValue
	clen    [20]byte

	md      structpb.Struct
	nsVal   structpb.Value
	nsKind  structpb.Value_StructValue
	ns      structpb.Struct
	dstVal  structpb.Value
	dstKind structpb.Value_StringValue
}

// newDecision builds the decision response. asBody selects a request body
// response (BUFFERED modes) instead of a request headers response.
// contentLength < 0 omits the header.
func newDecision(dest []byte, destStr string, pool []byte, contentLength int, remove []string, asBody bool) *decisionBlock {
	d := new(decisionBlock)
	n := 0
	add := func(k string, v []byte) {
		d.vals[n] = corev3.HeaderValue{Key: k, RawValue: v}
		d.set[n].Header = &d.vals[n]
		d.set[n].AppendAction = corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD
		d.setPtrs[n] = &d.set[n]
		n++
	}
	add(HeaderDestination, dest)
	add(HeaderPool, pool)
	if contentLength >= 0 {
		add("content-length", strconv.AppendInt(d.clen[:0], int64(contentLength), 10))
	}
	d.hm.SetHeaders = d.setPtrs[:n]
	d.hm.RemoveHeaders = remove
	d.cr.HeaderMutation = &d.hm
	d.cr.ClearRouteCache = true

	d.dstKind.StringValue = destStr
	d.dstVal.Kind = &d.dstKind
	d.ns.Fields = map[string]*structpb.Value{MetadataDestination: &d.dstVal}
	d.nsKind.StructValue = &d.ns
	d.nsVal.Kind = &d.nsKind
	d.md.Fields = map[string]*structpb.Value{MetadataNamespace: &d.nsVal}
	d.pr.DynamicMetadata = &d.md

	if asBody {
		d.br.Response = &d.cr
		d.body.RequestBody = &d.br
		d.pr.Response = &d.body
	} else {
		d.hr.Response = &d.cr
		d.hdrs.RequestHeaders = &d.hr
		d.pr.Response = &d.hdrs
	}
	return d
}

// streamedBlock is one FULL_DUPLEX_STREAMED body chunk response in one
// allocation.
type streamedBlock struct {
	pr      extprocv3.ProcessingResponse
	reqBody extprocv3.ProcessingResponse_RequestBody
	rspBody extprocv3.ProcessingResponse_ResponseBody
	br      extprocv3.BodyResponse
	cr      extprocv3.CommonResponse
	bm      extprocv3.BodyMutation
	sr      extprocv3.BodyMutation_StreamedResponse
	sbr     extprocv3.StreamedBodyResponse
}

func newStreamedChunk(request bool, b []byte, eos bool) *extprocv3.ProcessingResponse {
	s := new(streamedBlock)
	s.sbr.Body, s.sbr.EndOfStream = b, eos
	s.sr.StreamedResponse = &s.sbr
	s.bm.Mutation = &s.sr
	s.cr.BodyMutation = &s.bm
	s.br.Response = &s.cr
	if request {
		s.reqBody.RequestBody = &s.br
		s.pr.Response = &s.reqBody
	} else {
		s.rspBody.ResponseBody = &s.br
		s.pr.Response = &s.rspBody
	}
	return &s.pr
}

// respHeadersBlock is a response-headers answer in one allocation.
type respHeadersBlock struct {
	pr extprocv3.ProcessingResponse
	rh extprocv3.ProcessingResponse_ResponseHeaders
	hr extprocv3.HeadersResponse
	cr extprocv3.CommonResponse
	hm extprocv3.HeaderMutation
	rm [1]string
}

func newResponseHeaders(removeContentLength bool) *extprocv3.ProcessingResponse {
	b := new(respHeadersBlock)
	if removeContentLength {
		b.rm[0] = "content-length"
		b.hm.RemoveHeaders = b.rm[:]
		b.cr.HeaderMutation = &b.hm
	}
	b.hr.Response = &b.cr
	b.rh.ResponseHeaders = &b.hr
	b.pr.Response = &b.rh
	return &b.pr
}
