// Package kvevents owns the picker's exact view of what each model
// server holds in its KV cache, built from the KV-cache events the
// servers publish (vLLM --kv-events-config with the zmq publisher): one
// subscriber per server follows its ZMQ PUB stream (BlockStored,
// BlockRemoved, AllBlocksCleared, in every wire format vLLM has used),
// recovers missed batches from the server's replay socket, notices a
// restarted engine and drops its stale blocks, and keeps each pool's
// Index: per server, the router's key of every block in its GPU cache.
//
// A request is matched to those blocks by its token ids, tokenized the
// way the engine tokenizes it (see Tokenizer), keyed block by block
// exactly as the events' blocks are (AppendKeys): a Query then tells, for
// any of the pool's servers, how many prompt tokens it would find cached
// there (what vLLM reports as cached_tokens). Servers whose view is not
// exact (not synced, events missing or stale) are reported as such, and
// the caller falls back to its estimate for them.
//
// The package knows nothing about Envoy or scheduling; picker/sched
// consults a Query through its CachedTokens method.
package kvevents
