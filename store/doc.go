// Package store owns switchyard's on-disk state: one bbolt file that makes
// restarts warm, even when Consul is down. It persists the last good merged
// registry.State (every source, Consul endpoints included), endpoint health
// and drain state, the last scraped metrics per endpoint, the picker's
// prefix-cache blobs, the session-affinity map, the Consul
// blocking-query indexes and the tenants' usage in hourly buckets. (xDS
// versions are content hashes: nothing to persist.)
//
// Components depend on the Store interface; File (Open) implements it on
// a bbolt file, and storetest.Fake in memory, for unit tests.
//
// The store never imports the picker or the xDS packages: everything it keeps
// is a plain record defined here (Metrics, Health, Session, opaque prefix
// blobs) or a registry.State, converted to and from versioned record structs
// so the registry types can evolve without breaking old files.
//
// # Writes
//
// Save* methods only record the latest value in memory and wake a single
// background writer, which flushes everything pending in one bbolt Update
// transaction at most every Options.FlushInterval (200 ms by default), on
// Flush and on Close. Saves never touch the disk on the caller's goroutine,
// and a newer value of the same item replaces an older, unflushed one.
//
// Usage is the exception, because it adds up rather than replaces and is
// billed: AddUsage appends one line to a journal file beside the store
// ("<path>.usage-0" and "-1", used in turn) before it returns, a write
// into the kernel's page cache that a SIGKILL of switchyard cannot lose
// (~4-8 µs; no fsync: a crash of the machine loses what was added since
// the last commit, at most FlushInterval). The writer folds the journal
// into the usage bucket with its next commit, together with the sequence
// number of the last record folded; Open replays records after that
// number, so a record is never lost nor counted twice.
//
// # On-disk layout (schema version 1)
//
// All integers stored as values are 8-byte big-endian. Records are JSON
// objects carrying their own record version in "v".
//
//	meta      "app"          "switchyard-store" (application id; a bbolt file
//	                         without it is foreign and is moved aside)
//	          "schema"       schema version (uint64)
//	          "created_at"   RFC 3339 time the file was created
//	          "flushed_at"   RFC 3339 time of the last batched flush
//	          "xds_version"  written by switchyard before 2026-11-26, when
//	                         xDS versions were counted; now ignored (they
//	                         are content hashes)
//	state     "current"      stateRecord: the last saved registry.State,
//	                         including its Version
//	metrics   pool NUL addr  metricsRecord {waiting, running, kv_usage, scraped_at}
//	health    pool NUL addr  healthRecord {healthy, draining, reason, since}
//	prefix    pool NUL addr  opaque blob exported by the picker (size-capped)
//	sessions  session id     sessionRecord {pool, endpoint, expires}
//	          "usage_folded" sequence number of the last usage journal
//	                         record committed (uint64)
//	consul    selector key   last Consul index (uint64)
//	usage     hour tenant model  usageRecord {requests, errors, prompt_tokens,
//	                         cached_tokens, completion_tokens}; the key is
//	                         the hour's start (8-byte big-endian Unix
//	                         seconds), the tenant (uvarint length, bytes)
//	                         and the model. Added in place to schema 1:
//	                         older switchyards ignore the bucket.
//
// # Opening
//
// Open hands the file to bbolt, which takes an exclusive lock on it (a
// second process fails after Options.LockTimeout with ErrLocked) and checks
// its meta pages; Open then reads every record once, turning any fault on a
// damaged page into an error. A file bbolt rejects (not a bbolt database,
// damaged meta pages), one with a page that faults or fails to decode, and
// one that belongs to another application is renamed to
// "<path>.corrupt-<UTC timestamp>" (never overwritten) and a fresh store is
// created; File.Recovery and a warning log line say so. A file the
// operating system refuses to open (missing directory, permissions) is
// never moved. A file written by a newer schema than this binary knows is
// left untouched and Open fails with ErrNewerSchema. Older schemas are
// migrated forward, one version at a time, in a single transaction.
package store
