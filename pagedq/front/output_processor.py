"""The front's side of each step: the engine core's token-id deltas become text and
`RequestOutput`s.

Per new token: the sequence's incremental detokenizer (pagedq.front.detokenizer), stop
strings (a stop string ends the sequence here and the core is told to stop it; the
tokens the core made meanwhile are dropped, as in vLLM V1), logprobs with their decoded
tokens. Per request, whenever it changed: a `RequestOutput` of the kind it asked for:
CUMULATIVE (everything so far), DELTA (only what is new since its last output) or
FINAL_ONLY (once, when it ends).

Whatever throws while one request's tokens are processed fails that request alone
("processing its new token failed"); the core is told to drop it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pagedq.beam_search import BeamSearchParams
from pagedq.core.messages import CoreOutputs
from pagedq.front.detokenizer import IncrementalDetokenizer
from pagedq.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, RequestOutputKind
from pagedq.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class SequenceState:
    __slots__ = (
        "index", "token_ids", "detokenizer", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason",
        "sent_tokens", "sent_chars", "sent_end",
    )

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer | None, wants_logprobs: bool):
        self.index = index
        self.token_ids: list[int] = []
        self.detokenizer = detokenizer
        self.logprobs: list[dict[int, Logprob]] | None = [] if wants_logprobs else None
        # None unless the request asked for logprobs (vLLM V1).
        self.cumulative_logprob: float | None = 0.0 if wants_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # What DELTA outputs have already carried.
        self.sent_tokens = 0
        self.sent_chars = 0
        self.sent_end = False

    @property
    def text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        if self.detokenizer is not None:
            self.detokenizer.finish()

    def completion(self, delta: bool) -> CompletionOutput:
        if not delta:
            return CompletionOutput(
                index=self.index, text=self.text, token_ids=list(self.token_ids),
                cumulative_logprob=self.cumulative_logprob,
                logprobs=list(self.logprobs) if self.logprobs is not None else None,
                finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            )
        text = self.text
        start = self.sent_tokens
        completion = CompletionOutput(
            index=self.index, text=text[self.sent_chars :], token_ids=self.token_ids[start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs[start:] if self.logprobs is not None else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
        )
        self.sent_tokens, self.sent_chars = len(self.token_ids), len(text)
        self.sent_end = self.finish_reason is not None
        return completion

    @property
    def has_news(self) -> bool:
        """Tokens or an end that no DELTA output has carried yet."""
        return self.sent_tokens < len(self.token_ids) or (self.finish_reason is not None and not self.sent_end)


class RequestState:
    __slots__ = (
        "request_id", "core_id", "prompt", "prompt_token_ids", "output_kind", "metrics",
        "num_cached_tokens", "seqs", "error", "invalid_input", "final_outputs", "finished", "num_ended",
        "prompt_logprobs",
    )

    def __init__(self, request_id: str, core_id: int, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, beam: BeamSearchParams | None, output_kind: RequestOutputKind,
                 arrival_time: float, tokenizer):
        self.request_id = request_id
        self.core_id = core_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_kind = output_kind
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.error: str | None = None
        self.invalid_input = False
        # Beam search's best hypotheses, once the search ends.
        self.final_outputs: list[CompletionOutput] | None = None
        self.finished = False
        self.num_ended = 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None and beam is None else None
        )
        wants_logprobs = params.logprobs is not None
        # Beams are decoded once, when the search picks its best.
        detokenize = tokenizer is not None and beam is None
        self.seqs = [
            SequenceState(index, IncrementalDetokenizer(tokenizer, prompt_token_ids, params) if detokenize else None,
                          wants_logprobs)
            for index in range(1 if beam is not None else params.n)
        ]

    @property
    def all_ended(self) -> bool:
        return self.final_outputs is not None or self.num_ended == len(self.seqs)

    def end_sequence(self, seq: SequenceState, reason: str, stop_reason: int | str | None = None) -> None:
        self.num_ended += 1
        seq.finish(reason, stop_reason)

    def end(self, reason: str) -> None:
        """Every sequence still running ends with `reason` (abort, error)."""
        for seq in self.seqs:
            if seq.finish_reason is None:
                self.end_sequence(seq, reason)

    def output(self) -> RequestOutput:
        """DELTA outputs carry the sequences with news, each with what is new since its
        last output; the others everything."""
        if self.final_outputs is not None:
            outputs = self.final_outputs
        elif self.output_kind is RequestOutputKind.DELTA:
            outputs = [seq.completion(True) for seq in self.seqs if seq.has_news]
        else:
            outputs = [seq.completion(False) for seq in self.seqs]
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids, outputs=outputs,
            finished=self.finished, metrics=self.metrics, num_cached_tokens=self.num_cached_tokens, error=self.error,
            invalid_input=self.invalid_input,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
        )

    def final_output(self) -> RequestOutput:
        """The last output; whatever threw may be a detokenizer, and reading its text would
        throw again: then the text goes with it."""
        try:
            return self.output()
        except Exception:
            for seq in self.seqs:
                seq.detokenizer = None
            return self.output()


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[int, RequestState] = {}  # by core id
        # Sequences a stop string ended, for the core to stop: (core id, sequence index).
        self.stopped: list[tuple[int, int]] = []
        # Requests the front failed, for the core to drop.
        self.dropped: list[int] = []
        # Running requests that made progress since their last output, with defer (by core id).
        self.deferred: dict[int, RequestState] = {}

    def add(self, state: RequestState) -> None:
        self.states[state.core_id] = state

    def process(self, out: CoreOutputs, defer: bool = False) -> list[RequestOutput]:
        """The outputs of the requests `out` moved on. `defer`: only those that ended; the
        others are noted for deferred_outputs() (building an output decodes its text)."""
        states = self.states
        for core_id, when, num_cached in out.scheduled:
            state = states.get(core_id)
            if state is not None:
                state.metrics.first_scheduled_time = when
                state.num_cached_tokens = num_cached
        ends = {(core_id, index): (reason, stop) for core_id, index, reason, stop in out.finished}
        logprobs = {entry[0]: entry for entry in out.logprobs}
        timestamp = out.timestamp
        touched: dict[int, RequestState] = {}
        for row, (core_id, index, token) in enumerate(zip(out.request_ids, out.seq_indexes, out.token_ids)):
            state = states.get(core_id)
            if state is None or state.finished:
                continue
            seq = state.seqs[index]
            if seq.finish_reason is not None:
                continue  # a stop string ended it; the core made this token before it heard
            try:
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = timestamp
                seq.token_ids.append(token)
                end = ends.get((core_id, index)) if ends else None
                if logprobs and row in logprobs:
                    self._add_logprobs(seq, logprobs[row])
                if seq.detokenizer is not None:
                    # A stop string found in the text ends the sequence even at its length limit.
                    stop_string = seq.detokenizer.update([token], stop_terminated=end is not None and end[0] == "stop")
                    if stop_string is not None:
                        if end is None:
                            self.stopped.append((core_id, index))
                        end = ("stop", stop_string)
                if end is not None:
                    state.end_sequence(seq, *end)
            except Exception as exc:
                self._token_fault(state, exc)
            touched[core_id] = state
        for core_id, entries in out.prompt_logprobs:
            state = states.get(core_id)
            if state is not None and not state.finished and state.prompt_logprobs is not None:
                state.prompt_logprobs += [
                    {token: Logprob(logprob=logprob, rank=rank, decoded_token=self._token_text(token))
                     for token, logprob, rank in entry}
                    for entry in entries
                ]
        for core_id, index, tokens, first_token_time in out.token_chunks:
            state = states.get(core_id)
            if state is None or state.finished:
                continue
            seq = state.seqs[index]
            try:
                if state.metrics.first_token_time is None or first_token_time < state.metrics.first_token_time:
                    state.metrics.first_token_time = first_token_time
                seq.token_ids += tokens
                end = ends.get((core_id, index))
                if seq.detokenizer is not None:
                    seq.detokenizer.update(tokens, stop_terminated=end is not None and end[0] == "stop")
                if end is not None:
                    state.end_sequence(seq, *end)
            except Exception as exc:
                self._token_fault(state, exc)
            touched[core_id] = state
        for core_id, error, invalid_input in out.failed:
            state = states.get(core_id)
            if state is not None and not state.finished:
                self._fail(state, error, invalid_input=invalid_input)
                touched[core_id] = state
        for core_id, hypotheses in out.beams:
            state = states.get(core_id)
            if state is not None and not state.finished:
                state.final_outputs = self._beam_outputs(hypotheses)
                touched[core_id] = state
        results = []
        final_only = RequestOutputKind.FINAL_ONLY
        for state in touched.values():
            if state.error is not None or state.all_ended:
                results.append(self._close(state))
            elif state.output_kind is final_only:
                continue
            elif defer:
                self.deferred[state.core_id] = state
            else:
                results.append(state.output())
        return results

    def deferred_outputs(self, wanted: Callable[[str], bool] | None = None) -> list[RequestOutput]:
        """The outputs of the running requests that process(defer=True) moved on since
        their last output, built now: one per request however many steps it took. With
        `wanted(request_id)`, only those; the others stay deferred for a later call."""
        if wanted is None:
            states, self.deferred = self.deferred, {}
            return [state.output() for state in states.values()]
        taken = [state for state in self.deferred.values() if wanted(state.request_id)]
        for state in taken:
            del self.deferred[state.core_id]
        return [state.output() for state in taken]

    def abort(self, state: RequestState) -> RequestOutput:
        """The request ends now; its final output, finish_reason "abort"."""
        state.end("abort")
        return self._close(state)

    def _close(self, state: RequestState) -> RequestOutput:
        state.finished = True
        state.metrics.finished_time = time.time()
        del self.states[state.core_id]
        self.deferred.pop(state.core_id, None)
        return state.final_output()

    def _token_fault(self, state: RequestState, exc: Exception) -> None:
        """Processing a request's tokens threw: that request fails alone, and the core drops it."""
        self._fail(state, f"processing its new token failed: {exc!r}", exc)
        self.dropped.append(state.core_id)

    def _fail(self, state: RequestState, error: str, exc: BaseException | None = None, invalid_input: bool = False) -> None:
        if state.error is not None:
            return
        if exc is not None:
            logger.warning("request %s failed alone: %s", state.request_id, error, exc_info=exc)
        state.error, state.invalid_input = error, invalid_input
        try:
            state.end("error")
        except Exception:
            for seq in state.seqs:
                seq.detokenizer = None
            state.end("error")

    def _add_logprobs(self, seq: SequenceState, entry: tuple[int, float, list[tuple[int, float, int]]]) -> None:
        _, sampled, top = entry
        detokenizer = seq.detokenizer
        seq.logprobs.append({
            token: Logprob(logprob=logprob, rank=rank,
                           decoded_token=detokenizer.decode_token(token) if detokenizer is not None else None)
            for token, logprob, rank in top
        })
        seq.cumulative_logprob += sampled

    def _token_text(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _beam_outputs(self, hypotheses) -> list[CompletionOutput]:
        tokenizer = self.tokenizer
        return [
            CompletionOutput(
                index=index,
                text=tokenizer.decode(h.token_ids, skip_special_tokens=True) if tokenizer is not None else "",
                token_ids=list(h.token_ids), cumulative_logprob=h.cumulative_logprob, logprobs=None,
                finish_reason=h.finish_reason,
            )
            for index, h in enumerate(hypotheses)
        ]
