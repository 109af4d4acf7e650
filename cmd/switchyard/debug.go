package main

import (
	"net/http"
	"net/http/pprof"
)

// debugHandler serves Go's profiles (net/http/pprof) for -debug-addr: CPU
// and heap profiles of a running serve, for finding where its time and
// memory go. It is off unless that flag is set, and meant for a loopback
// address: profiles are not authenticated.
func debugHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}
