"""Builds the worker's engine from the service settings (one place maps Settings → EngineArgs)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pagedq.config import EngineArgs
from pagedq.settings import Settings
from pagedq.structured_outputs_params import preload_grammar_engine

if TYPE_CHECKING:
    import torch

    from pagedq.front.llm_engine import LLMEngine


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
    from pagedq import LLMEngine
    from worker.host_threads import set_torch_threads
    from worker.model_runner import resolve_device

    threads = torch_threads(settings, resolve_device(settings.device))
    if threads is not None:
        set_torch_threads(threads)
    # Settings named as EngineArgs' fields pass through when given.
    given = {name: getattr(settings, name) for name in _ENGINE_SETTINGS if getattr(settings, name) is not None}
    # The worker's engine core runs in a process of its own unless told otherwise: its steps
    # then never wait on the worker's Redis I/O, RQ bookkeeping or output processing, which
    # share one GIL (`pagedq bench serve`, bench/results/2026-11-26-serve-core-process.md).
    given.setdefault("core_process", True)
    # One request's share of the engine, as the api checks it (a job no api checked, or one
    # checked by an api with other settings, is refused here all the same).
    given["max_seqs_per_request"] = settings.seqs_per_request
    args = EngineArgs(model=settings.require_model(), num_gpu_blocks_override=settings.num_gpu_blocks, **given)
    # The engine first: its core process starts loading at once, beside the front's own loading.
    engine = LLMEngine.from_engine_args(args)
    preload_grammar_engine()  # jobs with a shape are validated here too: not at the first one's cost
    return engine


_ENGINE_SETTINGS = sorted((set(Settings.model_fields) & EngineArgs.field_names()) - {"model"})
