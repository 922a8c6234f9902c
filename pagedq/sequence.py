"""A request's state inside the engine, from arrival to finish.

A `Request` is what a client asked for: one prompt, one SamplingParams (or beam search).
It owns one `Sequence` per output (``n`` of them for parallel sampling, one per live
beam for beam search). The prompt is prefilled once by the first sequence; when it
completes, the others branch off it and share its KV blocks copy-on-write.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from pagedq.beam_search import BeamSearch
from pagedq.outputs import CompletionOutput, FinishReason, Logprob, RequestMetrics, RequestOutput, RequestOutputKind
from pagedq.sampling_params import SamplingParams

_arrival_counter = itertools.count()
_sequence_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV blocks moved to CPU memory
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    priority: int = 0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Breaks priority ties first come first served; survives preemption.
    arrival_index: int = field(default_factory=lambda: next(_arrival_counter))
    seqs: list[Sequence] = field(default_factory=list)
    # Cached prompt tokens found in the prefix cache when the first sequence was admitted.
    num_cached_tokens: int = 0
    # Beam search's state; `params` then holds the settings every beam shares.
    beam_search: BeamSearch[Sequence] | None = None
    # Whether the other outputs (or beams) have branched off the first sequence; until
    # then it holds scheduler slots for all of them.
    branched: bool = False
    aborted: bool = False
    # Set when something this request caused failed it (see LLMEngine._fail_request).
    error: str | None = None
    # Set when the outputs are not the sequences' own (beam search's best hypotheses).
    final_outputs: list[CompletionOutput] | None = None

    @property
    def width(self) -> int:
        """How many sequences the request runs at once after branching."""
        return self.beam_search.params.beam_width if self.beam_search is not None else self.params.n

    @property
    def is_finished(self) -> bool:
        if self.aborted or self.error is not None or self.final_outputs is not None:
            return True
        return self.beam_search is None and (self.branched or self.width == 1) and all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=self.final_outputs if self.final_outputs is not None else [seq.completion() for seq in self.seqs],
            finished=self.is_finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
        )


@dataclass(eq=False)
class Sequence:
    request: Request
    # 0..n-1: which of the request's outputs this is.
    index: int
    # Prompt then outputs; kept beside output_token_ids so neither is rebuilt per step.
    token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose keys and values are in the KV cache. Everything past it is prefilled
    # (possibly in chunks) before the next token can be sampled.
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # None unless the request asked for logprobs (vLLM V1).
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    num_preemptions: int = 0
    # Set by the engine: per-sequence RNG (when seeded) and incremental detokenizer.
    generator: Any = None
    detokenizer: Any = None
    # Distinguishes this sequence from every other, e.g. a beam from the beam it replaced.
    uid: int = field(default_factory=lambda: next(_sequence_counter))

    @property
    def seq_id(self) -> str:
        """Unique inside the engine: the block manager's key for this sequence's blocks."""
        return f"{self.request.request_id}#{self.uid}"

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Lower runs first: smaller priority value, then earlier arrival (vLLM's convention)."""
        return (self.request.priority, self.request.arrival_index, self.index)

    @property
    def text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
