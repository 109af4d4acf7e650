#!/bin/sh
# Entrypoint of the Envoy stand-in, behaving as the official image's does:
# a first argument that is a flag means `envoy FLAGS`; $loglevel adds
# --log-level; started as root (and ENVOY_UID is not 0) it runs Envoy as
# the envoy user, optionally renumbered by ENVOY_UID/ENVOY_GID.
set -e
case "$1" in
-*) set -- envoy "$@" ;;
esac
if [ "$1" = envoy ] && [ -n "$loglevel" ]; then
	set -- "$@" --log-level "$loglevel"
fi
if [ "$(id -u)" = 0 ] && [ "$ENVOY_UID" != 0 ]; then
	[ -z "$ENVOY_UID" ] || usermod -u "$ENVOY_UID" envoy
	[ -z "$ENVOY_GID" ] || groupmod -g "$ENVOY_GID" envoy
	# Envoy logs to the container's stdout and stderr.
	chown envoy:envoy /dev/stdout /dev/stderr 2>/dev/null || true
	set -- setpriv --reuid=envoy --regid=envoy --init-groups "$@"
fi
exec "$@"
