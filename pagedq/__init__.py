"""pagedq: continuous batching over a paged KV cache, offline (`LLM`) or as a Redis-backed service
(`Client` talks to it).

The contracts (SamplingParams, outputs) import cheaply; the engine and its torch/model
code load only when `LLM` or `LLMEngine` is first touched, so the api process never
imports model code.
"""

from pagedq.beam_search import BeamSearchParams
from pagedq.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedq.sampling_params import SamplingParams

__all__ = [
    "Client",
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "Logprob",
]

_LAZY = {"LLM": "pagedq.front.llm", "LLMEngine": "pagedq.front.llm_engine", "EngineArgs": "pagedq.config", "Client": "pagedq.client"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedq' has no attribute {name!r}")
