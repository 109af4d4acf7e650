package tenant

import "time"

// Usage is what one request of a tenant used, as the picker reports it
// when the request ends: one request, an error when it failed (a local
// reply such as 403 or 429, an error status from the server, or no
// response at all), and the tokens its response's usage reported.
type Usage struct {
	Time   time.Time
	Tenant string
	// Model is the client's model name when the configuration declares it
	// (or the tenant's models list names it), "other" for other names, ""
	// when the request named no model.
	Model                                        string
	Requests, Errors                             int64
	PromptTokens, CachedTokens, CompletionTokens int64
}

// Recorder receives every request's Usage. Record is called on the
// request's goroutine before its response completes: it must be quick and
// safe for concurrent use.
type Recorder interface {
	Record(u Usage)
}
