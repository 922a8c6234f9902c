"""Builds the worker's engine from the service settings (one place maps Settings → EngineArgs)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pagedq.settings import Settings

if TYPE_CHECKING:
    import torch

    from pagedq.engine import LLMEngine


def torch_threads(settings: Settings, device: torch.device) -> int | None:
    """The worker's torch CPU thread count (None: leave torch's default).

    On a CPU device the api, Redis and clients share the engine's cores. With every core
    in torch's thread pool, one preempted pool thread stalls each parallel op: engine steps
    on a 2-core machine were seen to take 30-60x longer. So one core is left free."""
    if settings.torch_threads is not None:
        return settings.torch_threads
    if device.type == "cpu":
        return max(1, (os.cpu_count() or 1) - 1)
    return None


def build_engine(settings: Settings) -> LLMEngine:
    import torch

    from pagedq import EngineArgs, LLMEngine
    from worker.model_runner import resolve_device

    threads = torch_threads(settings, resolve_device(settings.device))
    if threads is not None:
        torch.set_num_threads(threads)
    args = EngineArgs(
        model=settings.require_model(),
        device=settings.device,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        num_gpu_blocks_override=settings.num_gpu_blocks,
    )
    return LLMEngine.from_engine_args(args)
