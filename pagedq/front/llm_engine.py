"""LLMEngine: requests in, `RequestOutput`s out, one `step()` at a time — the front of the
engine core, as vLLM V1's LLMEngine is.

The front does what needs text and the caller's ids: input processing (tokenize and
check each request: pagedq.front.input_processor), output processing (detokenize, stop
strings, outputs of the kind asked: pagedq.front.output_processor), and the mapping of
the caller's request ids to the core's. The core (pagedq.core.engine_core) runs the
steps, in this process or its own (`EngineArgs.core_process`, pagedq.front.core_client).
The offline `LLM` and the service's batch worker both drive this class.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pagedq.beam_search import BeamSearchParams
from pagedq.config import EngineArgs
from pagedq.core.messages import AddRequest, CoreInfo
from pagedq.front.core_client import make_core_client
from pagedq.front.input_processor import InputProcessor, PromptType
from pagedq.front.output_processor import OutputProcessor, RequestState
from pagedq.model_info import load_hf_config, load_tokenizer
from pagedq.outputs import RequestOutput, RequestOutputKind
from pagedq.sampling_params import SamplingParams

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.core = make_core_client(args, self._load)
        info: CoreInfo = self.core.info
        self.core_info = info
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.device = torch.device(info.device)
        self.input_processor = InputProcessor(
            self.tokenizer, info.vocab_size, info.max_model_len, args.max_num_seqs, args.max_seqs_per_request
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        # The caller's ids of requests whose final output step() has not returned yet.
        self._states: dict[str, RequestState] = {}
        # Final outputs made outside a step (aborts), returned by the next step().
        self._finals: list[RequestOutput] = []
        self._core_ids = itertools.count()
        self._step_timings = None

    def _load(self) -> set[int]:
        """The front's config and tokenizer (a core process of its own loads its modules
        meanwhile); the eos token ids the core is built with."""
        hf_config = load_hf_config(self.args.model)
        self.tokenizer = None if self.args.skip_tokenizer_init else load_tokenizer(self.args.model)
        self._eos_token_ids = eos_token_ids(self.args.model, hf_config, self.tokenizer)
        return self._eos_token_ids

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def engine_core(self):
        """The EngineCore itself when it runs in this process (tests and benchmarks look
        inside it); None when it runs in its own."""
        return getattr(self.core, "core", None)

    def _inproc_core(self):
        core = self.engine_core
        if core is None:
            raise RuntimeError("the engine core runs in its own process (core_process=True): its internals are not here")
        return core

    @property
    def block_manager(self):
        return self._inproc_core().block_manager

    @property
    def runner(self):
        return self._inproc_core().runner

    @property
    def scheduler(self):
        return self._inproc_core().scheduler

    @property
    def eos_token_ids(self) -> set[int]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, token_ids: set[int]) -> None:
        """For tests that make an ordinary token the eos; applies to requests added later."""
        self._eos_token_ids = set(token_ids)
        self.core.set_eos_token_ids(self._eos_token_ids)

    def set_step_timings(self, timings) -> None:
        """Record where each step's host time goes (pagedq.core.step_timings); None stops."""
        self._inproc_core().step_timings = timings
        self._step_timings = timings

    # --- requests -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        report_every_s: float | None = None,
    ) -> None:
        """Queue a request: sampled (SamplingParams) or beam search (BeamSearchParams).
        Raises ValueError (naming the field) for input that can never run; the engine's
        other requests are unaffected.

        `report_every_s`: for a caller that looks at this request's progress only every so
        often (the service's worker, for a job nobody streams): its outputs move on at most
        this often while it runs, and at its end, as its tokens come from the core in
        chunks instead of one a step. None: every step."""
        processor = self.input_processor
        sampling, beam = processor.params(params)
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self._states:
            # An aborted id is free again once step() has returned its final output.
            raise ValueError(f"request_id: {request_id!r} is already in the engine")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        text, token_ids = processor.tokenize(prompt)
        processor.check(token_ids, sampling, beam)
        bad_words = processor.bad_words_token_ids(sampling)
        arrival_time = arrival_time if arrival_time is not None else time.time()
        core_id = next(self._core_ids)
        state = RequestState(request_id, core_id, text, token_ids, sampling, beam, output_kind, arrival_time,
                             self.tokenizer)
        # Nobody watches a final-only request's tokens go by, nor those of one looked at
        # only every report_every_s, unless a stop string or logprobs need each one: the
        # core then sends them in chunks (once, when each sequence ends, if final-only).
        # (A beam search reports its hypotheses its own way, whatever report_every_s says.)
        final_only = output_kind is RequestOutputKind.FINAL_ONLY
        per_token = bool(sampling.stop_strings) or sampling.logprobs is not None
        chunked = not per_token and (final_only or (report_every_s is not None and beam is None))
        report = report_every_s if chunked and not final_only else None
        self.core.add_request(AddRequest(core_id, token_ids, sampling, arrival_time, priority, beam, not chunked, report,
                                         bad_words))
        self._states[request_id] = state
        self.output_processor.add(state)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now and free their KV blocks; unknown or finished ids are ignored.
        The next step() returns each one's final output, finish_reason "abort"; until then
        the id cannot be reused."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        core_ids = []
        for rid in ids:
            state = self._states.get(rid)
            if state is None or state.finished:
                continue
            core_ids.append(state.core_id)
            self._finals.append(self.output_processor.abort(state))
        self.core.abort_requests(core_ids)

    def check_alive(self) -> None:
        """Raises EngineDeadError if the engine is gone (its core process, or one of its
        tensor-parallel ranks), for a caller with nothing to step (an idle worker)."""
        self.core.check_alive()

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def get_num_unfinished_requests(self) -> int:
        return sum(1 for state in self._states.values() if not state.finished)

    # --- the loop -----------------------------------------------------------------------

    def step(self, defer_outputs: bool = False) -> list[RequestOutput]:
        """One engine step; returns the outputs of requests that produced tokens or
        finished (FINAL_ONLY requests: only when they finish).

        `defer_outputs`: only the outputs of requests that finished; those of the others
        wait for deferred_outputs(), for a caller that looks at progress less often than
        every step (the service's worker: once per Redis round trip), so a running
        request's text is decoded, and its output built, once per look instead of per step.

        Whatever one request causes to throw (its forward, sampling, detokenization, stop
        check) fails that request alone, its output finished with `error` set; the step
        carries on for the others. A step that raises for everyone raises here; the core
        has then dropped every request, and the caller aborts them."""
        outputs, self._finals = self._finals, []
        processor = self.output_processor
        timings = self._step_timings
        if timings is not None:
            timings.begin()
        if processor.states:
            for core_outputs in self.core.get_outputs(wait=not outputs):
                outputs += processor.process(core_outputs, defer_outputs)
            if timings is not None:
                timings.phase("output")
            if processor.stopped:
                self.core.stop_sequences(processor.stopped)
                processor.stopped = []
            if processor.dropped:
                self.core.abort_requests(processor.dropped)
                processor.dropped = []
        for output in outputs:
            if output.finished:
                del self._states[output.request_id]
        if timings is not None:
            timings.end()
        return outputs

    def deferred_outputs(self, wanted: Callable[[str], bool] | None = None) -> list[RequestOutput]:
        """The outputs step(defer_outputs=True) held back: of each running request that
        made progress since its last output, one output, built now (with everything up to
        now, or for DELTA requests everything new since then). With `wanted(request_id)`,
        only those requests'; the others' wait for a later call."""
        return self.output_processor.deferred_outputs(wanted)

    # --- observability ------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        return self.core.stats()

    def shutdown(self) -> None:
        """Stops the engine core's process, when it has one (also done when the engine is collected)."""
        self.core.shutdown()


def eos_token_ids(model: str, hf_config, tokenizer) -> set[int]:
    """EOS ids from the generation config (which may list several), the model config and
    the tokenizer, as transformers' generate gathers them."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        candidates: list[Any] = [GenerationConfig.from_pretrained(model, local_files_only=True).eos_token_id]
    except OSError:
        candidates = []
    candidates += [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
