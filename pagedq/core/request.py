"""A request's state inside the engine core, from `add` to its last token.

A `CoreRequest` is one prompt with one SamplingParams (or beam search). It owns one
`Sequence` per output (``n`` of them for parallel sampling, one per live beam). The
prompt is prefilled once, by the first sequence; the others branch off it when the step
that completes the prompt is scheduled, sharing its KV blocks copy-on-write.

Tokens in flight. With overlapped steps the core schedules step N+1 before it knows the
tokens step N sampled: a sequence sampled in step N carries one *pending* token, counted
in `num_tokens` (so step N+1 computes its position, fed from the device) but not yet in
`token_ids` (which holds the tokens the host knows). The pending token becomes known when
step N is collected.

Nothing here knows about text: detokenization and stop strings belong to the front.
"""

from __future__ import annotations

import enum
import itertools
import math
from typing import Any

from pagedq.beam_search import BeamSearch
from pagedq.sampling_params import SamplingParams

_arrival_counter = itertools.count()
_sequence_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV blocks moved to CPU memory
    FINISHED = "finished"


class CoreRequest:
    __slots__ = (
        "request_id", "prompt_token_ids", "params", "arrival_time", "priority", "arrival_index", "seqs",
        "num_cached_tokens", "beam_search", "branched", "error", "first_scheduled_time",
        "sync", "max_output_tokens", "stop_reasons", "wants_logprobs", "stream", "report_every_s", "report_at",
        "first_token_time", "bad_words_token_ids", "grammar", "prompt_logprobs_done",
    )

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float,
        priority: int,
        eos_token_ids: set[int],
        max_model_len: int,
        beam_search: BeamSearch | None = None,
        stream: bool = True,
        report_every_s: float | None = None,
        bad_words_token_ids: list[list[int]] | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority
        # Breaks priority ties first come first served; survives preemption.
        self.arrival_index = next(_arrival_counter)
        self.seqs: list[Sequence] = []
        # Prompt tokens found in the prefix cache when the first sequence was admitted.
        self.num_cached_tokens = 0
        self.beam_search = beam_search
        # Whether the other outputs (or beams) have branched off the first sequence; until
        # then it holds scheduler slots for all of them.
        self.branched = False
        self.error: str | None = None
        self.first_scheduled_time: float | None = None
        # Whether each step's tokens are reported (else each sequence's in chunks: when it
        # ends and, with report_every_s, while it runs, from the first step at report_at on).
        self.stream = stream
        self.report_every_s = report_every_s
        self.report_at = arrival_time + report_every_s if report_every_s is not None else math.inf
        self.first_token_time: float | None = None
        self.bad_words_token_ids = bad_words_token_ids or []
        # Prompt positions whose next prompt token's logprob has been computed (reported
        # once, even when a preempted prefill runs again); all of them unless asked for.
        self.prompt_logprobs_done = 0 if params.prompt_logprobs is not None else len(prompt_token_ids) - 1
        # The compiled grammar of a structured output (pagedq.core.structured_outputs), once ready.
        self.grammar: Any = None
        penalties = params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        # Needs its last token on the host before its next step: beam search picks the next
        # beams there, penalties count output tokens there, bad words match them there.
        # Such a request sits out the step after each of its steps (see EngineCore); every
        # other request runs ahead. (A grammar needs its last token too, but only before
        # sampling: the core collects the step before early instead, see EngineCore.)
        self.sync = beam_search is not None or penalties or bool(self.bad_words_token_ids)
        self.wants_logprobs = params.logprobs is not None
        # The length limit (vLLM checks it first): max_tokens, or the context's end.
        limit = params.max_tokens if params.max_tokens is not None else math.inf
        self.max_output_tokens = int(min(limit, max_model_len - len(prompt_token_ids)))
        # Token id -> the stop_reason it finishes with: stop_token_ids name themselves, eos
        # (unless ignored) is None; eos wins where an id is both, as in vLLM V1's check.
        reasons: dict[int, int | None] = {t: t for t in params.stop_token_ids or ()}
        if not params.ignore_eos:
            reasons.update((t, None) for t in eos_token_ids)
        self.stop_reasons = reasons

    @property
    def reads_prefix_cache(self) -> bool:
        """A prompt whose logprobs are still owed is computed in full: cached positions would have no logits."""
        return self.prompt_logprobs_done >= len(self.prompt_token_ids) - 1

    @property
    def width(self) -> int:
        """How many sequences the request runs at once after branching."""
        return self.beam_search.params.beam_width if self.beam_search is not None else self.params.n


class Sequence:
    __slots__ = (
        "request", "index", "uid", "token_ids", "num_prompt_tokens", "num_pending", "num_computed_tokens",
        "status", "cumulative_logprob", "generator", "num_preemptions",
        "sort_key", "sample_step", "sample_row", "max_num_tokens", "params", "prompt_token_ids",
        "bad_words_token_ids", "grammar", "num_reported",
    )

    def __init__(self, request: CoreRequest, index: int, token_ids: list[int]):
        self.request = request
        # The request's, here for the sampler, which reads them every step.
        self.params = request.params
        self.prompt_token_ids = request.prompt_token_ids
        self.bad_words_token_ids = request.bad_words_token_ids
        # A structured output's matcher: where this sequence's tokens have taken its grammar.
        self.grammar: Any = None
        # 0..n-1: which of the request's outputs this is.
        self.index = index
        # The block manager's key: unique inside the engine (a beam differs from the one it replaced).
        self.uid = next(_sequence_counter)
        # Prompt then the outputs the host knows.
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        # Output tokens sent to the front in chunks so far (a request not streamed).
        self.num_reported = 0
        # Prompt plus the most outputs the length limit allows.
        self.max_num_tokens = self.num_prompt_tokens + request.max_output_tokens
        # Sampled by a step in flight, not yet known on the host (0 or 1).
        self.num_pending = 0
        # Positions whose KV is in the cache or being written by a step in flight.
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        # Beams rank by it; kept for beams only (the front sums logprobs for the others).
        self.cumulative_logprob = 0.0
        # Set when params.seed is not None: the sequence's own random stream.
        self.generator: Any = None
        self.num_preemptions = 0
        # Lower runs first: smaller priority value, then earlier arrival (vLLM's convention).
        self.sort_key = (request.priority, request.arrival_index, index)
        # The step that last sampled for this sequence, and its row there: a pending token
        # is read from that step's sampled ids on the device.
        self.sample_step = -1
        self.sample_row = -1

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_unreported_tokens(self) -> int:
        """Output tokens the host knows that no chunk has carried yet (a request not streamed)."""
        return len(self.token_ids) - self.num_prompt_tokens - self.num_reported

    @property
    def num_output_tokens(self) -> int:
        """Outputs so far, the one in flight included."""
        return len(self.token_ids) - self.num_prompt_tokens + self.num_pending

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def at_length_limit(self) -> bool:
        """Its last allowed token is sampled (maybe still in flight): nothing more to schedule."""
        return len(self.token_ids) + self.num_pending >= self.max_num_tokens
