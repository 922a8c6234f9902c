"""What the engine returns for a request: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

# "error": the request failed alone, from something it caused (RequestOutput.error says what).
FinishReason = Literal["stop", "length", "abort", "error"]


class RequestOutputKind(enum.Enum):
    """Which steps report a request, and with what (vLLM's names): every step with
    everything so far (the service streams from these), every step with only what is new
    since the request's last output, or only the last step (offline `LLM.generate`)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # One dict per generated token: token id -> Logprob (the top `logprobs` plus the sampled one).
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended generation, when one did.
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life in the engine."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # Why the request failed, when it did: the engine's other requests carried on.
    error: str | None = None
    # The error is its input's fault, the same on any engine (constraints that leave no token,
    # a grammar that does not compile): the service answers it as the client's error (4xx).
    invalid_input: bool = False
    # With SamplingParams.prompt_logprobs: per prompt token, None for the first (nothing
    # precedes it), then token id -> Logprob (the top alternatives and the prompt's token).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class BeamSearchSequence:
    """One of beam search's best hypotheses (vLLM's shape): `tokens` and `text` cover the
    prompt and the generated continuation."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: FinishReason | None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
