"""Builds the worker's engine from the service settings (one place maps Settings → EngineArgs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedq.settings import Settings

if TYPE_CHECKING:
    from pagedq.engine import LLMEngine


def build_engine(settings: Settings) -> LLMEngine:
    from pagedq import EngineArgs, LLMEngine

    args = EngineArgs(
        model=settings.require_model(),
        device=settings.device,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        num_gpu_blocks_override=settings.num_gpu_blocks,
    )
    return LLMEngine.from_engine_args(args)
