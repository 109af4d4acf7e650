#!/bin/sh
# Entrypoint of the Consul stand-in, behaving as the official image's does:
#  - a first argument that is a flag means `consul agent FLAGS`;
#  - `agent` gets -data-dir=/consul/data and -config-dir=/consul/config,
#    plus -bind/-client from CONSUL_BIND_INTERFACE/CONSUL_CLIENT_INTERFACE;
#  - CONSUL_LOCAL_CONFIG (JSON) is written to /consul/config/local.json;
#  - any other consul subcommand runs as `consul SUBCOMMAND ...`;
#  - started as root, it hands the data and config directories to the
#    consul user and drops to it.
set -e

data_dir=/consul/data
config_dir=/consul/config

iface_ip() {
	ip=$(ip -o -4 addr show dev "$1" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
	if [ -z "$ip" ]; then
		echo "no IPv4 address on interface '$1'" >&2
		exit 1
	fi
	echo "$ip"
}
bind_flag=""
client_flag=""
[ -z "$CONSUL_BIND_INTERFACE" ] || bind_flag="-bind=$(iface_ip "$CONSUL_BIND_INTERFACE")"
[ -z "$CONSUL_CLIENT_INTERFACE" ] || client_flag="-client=$(iface_ip "$CONSUL_CLIENT_INTERFACE")"

[ -z "$CONSUL_LOCAL_CONFIG" ] || printf '%s\n' "$CONSUL_LOCAL_CONFIG" > "$config_dir/local.json"

case "$1" in
-*) set -- agent "$@" ;;
esac
if [ "$1" = agent ]; then
	shift
	# shellcheck disable=SC2086 # the flags are empty or one word each
	set -- consul agent -data-dir="$data_dir" -config-dir="$config_dir" $bind_flag $client_flag "$@"
elif [ "$1" != consul ] && consul "$1" -h >/dev/null 2>&1; then
	set -- consul "$@"
fi

if [ "$1" = consul ] && [ "$(id -u)" = 0 ]; then
	for d in "$data_dir" "$config_dir"; do
		[ "$(stat -c %U "$d")" = consul ] || chown -R consul:consul "$d"
	done
	set -- setpriv --reuid=consul --regid=consul --init-groups "$@"
fi
exec "$@"
