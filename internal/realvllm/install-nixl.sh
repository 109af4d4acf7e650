#!/usr/bin/env bash
# Installs NIXL (nixl.lock) for the real-vLLM prefill/decode test into a
# directory outside the repository, cached by the hash of nixl.lock and this
# script; tests put it on the vLLM servers' PYTHONPATH. Needs the vLLM venv
# (install.sh) for its python. Prints the directory last.
#
#   internal/realvllm/install-nixl.sh [CACHE_DIR]     (default ~/.cache/switchyard)
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cache="${1:-${HOME}/.cache/switchyard}"
venv="$("$here/install.sh" "$cache")"
hash="$(cat "$here/nixl.lock" "$here/install-nixl.sh" | sha256sum | cut -c1-12)"
dir="$cache/nixl-$hash"

if [ -f "$dir/.complete" ]; then
	echo "$dir"
	exit 0
fi
log="$cache/nixl-$hash.log"
tmp="$dir.tmp"
rm -rf "$tmp"
echo "installing NIXL into $dir (about 60 MB; log: $log)" >&2
"$venv/bin/python" -m pip install --no-deps --no-cache-dir --require-hashes --target "$tmp" -r "$here/nixl.lock" >"$log" 2>&1 || {
	echo "install failed; last lines of $log:" >&2
	tail -20 "$log" >&2
	exit 1
}
rm -rf "$dir"
mv "$tmp" "$dir"
touch "$dir/.complete"
echo "$dir"
