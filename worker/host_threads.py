"""The size of torch's CPU thread pool (intra-op threads) for an engine.

On a CUDA device the host only prepares small tensors and launches kernels, and a pool with
a thread per core makes each of those small ops slower: the threads wake, spin and contend.
Measured on an H100 machine with 16 cores (bench/results/2026-11-24-h100.md), 56M model in
bf16 offline: 11.7k output tok/s with 16 threads, 22.3k with 1. So, as vLLM's GPU workers
do, an engine on CUDA shrinks the pool to one thread, unless the thread count was chosen
explicitly: OMP_NUM_THREADS in the environment (vLLM's contract too) or `set_torch_threads`.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def set_torch_threads(threads: int) -> None:
    """An explicit choice, which the CUDA default below then leaves alone."""
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def limit_host_threads_for_gpu() -> None:
    if "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() == 1:
        return
    logger.info("torch CPU threads %d -> 1 for a CUDA engine (set OMP_NUM_THREADS to choose)", torch.get_num_threads())
    torch.set_num_threads(1)
