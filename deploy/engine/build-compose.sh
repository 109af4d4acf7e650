#!/usr/bin/env bash
# Builds Docker Compose v2 (as a docker CLI plugin) and BuildKit's
# Dockerfile frontend from the Go module proxy, once per Compose version,
# into a cache directory outside the repository:
#
#   deploy/engine/build-compose.sh CACHE_DIR COMPOSE_VERSION
#
# writes CACHE_DIR/compose-VERSION/docker-compose and
# CACHE_DIR/compose-VERSION/dockerfile-frontend, then prints that directory.
#
# Compose is built as the main module of its own source tree: its go.mod
# has exclude directives, which `go install module@version` refuses. The
# frontend (the image behind `# syntax=docker/dockerfile:1`) is built in
# the same module graph, so it uses the BuildKit release Compose pins and
# shares most of its compiled packages with the Compose build.
set -euo pipefail

cache="$1"
version="$2"
out="$cache/compose-$version"
if [ -x "$out/docker-compose" ] && [ -x "$out/dockerfile-frontend" ]; then
	echo "$out"
	exit 0
fi

go="${GO:-go}"
work="$cache/compose-build-$version"
log="$work/build.log"
mkdir -p "$work"
echo "building Docker Compose $version and the Dockerfile frontend from the Go module proxy (once per machine; 10-20 min on 2 cores); log: $log" >&2
start=$(date +%s)
(
	set -x
	export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
	if [ ! -f "$work/src/go.mod" ]; then
		dir=$("$go" mod download -json "github.com/docker/compose/v2@v$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
		[ -n "$dir" ]
		rm -rf "$work/src.tmp"
		cp -r "$dir" "$work/src.tmp"
		chmod -R u+w "$work/src.tmp"
		mv "$work/src.tmp" "$work/src"
	fi
	cd "$work/src"
	"$go" build -trimpath -ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=v$version" \
		-o "$work/docker-compose" ./cmd
	"$go" build -trimpath -ldflags "-s -w" \
		-o "$work/dockerfile-frontend" github.com/moby/buildkit/frontend/dockerfile/cmd/dockerfile-frontend
) >"$log" 2>&1 || {
	echo "Compose build failed; the last lines of $log:" >&2
	tail -n 25 "$log" >&2
	exit 1
}
mkdir -p "$out.tmp"
mv "$work/docker-compose" "$work/dockerfile-frontend" "$out.tmp/"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "built Docker Compose $version in $(( $(date +%s) - start )) s" >&2
echo "$out"
