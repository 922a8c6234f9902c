"""LLMEngine: continuous batching over a paged KV cache, one `step()` at a time.

One step: the scheduler picks sequences and token counts → the model runner moves blocks
and runs one forward over all of them → the sampler draws a token for every sequence that
finished its prompt → tokens are appended, detokenized and checked against the stop
conditions → finished sequences free their blocks. `step()` returns the requests whose
output changed. The offline `LLM` and the service's batch worker both drive this class.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from blockmgr import BlockManager
from pagedq.beam_search import BeamSearch, BeamSearchParams
from pagedq.config import EngineArgs
from pagedq.model_info import check_prompt_fits, load_hf_config, load_tokenizer, resolve_max_model_len
from pagedq.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from pagedq.sampling_params import SamplingParams
from pagedq.sequence import Request, Sequence, SequenceStatus
from scheduler import ScheduledSequence, Scheduler, SchedulerConfig
from pagedq.detokenizer import IncrementalDetokenizer
from worker.model_runner import ModelRunner
from pagedq.sampler import Sampler

logger = logging.getLogger(__name__)

# What `add_request` accepts as a prompt, as vLLM's LLM.generate does.
PromptType = str | dict[str, Any]


@dataclass
class EngineCounters:
    prompt_tokens_computed: int = 0  # prompt positions whose KV was computed (cache hits excluded)
    tokens_computed: int = 0  # every position computed, recomputation after preemption included
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    steps: int = 0


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        hf_config = load_hf_config(args.model)
        self.max_model_len = resolve_max_model_len(hf_config, args.max_model_len)
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.model)
        self.runner = ModelRunner(args, hf_config, self.max_model_len)
        self._fit_max_model_len_to_cache()
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            args.block_size,
            watermark=args.watermark,
            enable_prefix_caching=args.enable_prefix_caching,
            num_cpu_blocks=self.runner.num_cpu_blocks,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.preemption_mode), self.block_manager
        )
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = _eos_token_ids(args.model, hf_config, self.tokenizer)
        self.device = self.runner.device
        self.sampler = Sampler(
            self.vocab_size, self.eos_token_ids, generator=torch.Generator(device=self.device).manual_seed(args.seed)
        )
        self.requests: dict[str, Request] = {}
        # Final outputs of aborted requests, returned by the next step().
        self._aborted_outputs: list[RequestOutput] = []
        self.counters = EngineCounters()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def _fit_max_model_len_to_cache(self) -> None:
        """Every request must fit the cache alone, or preempting the others could not save it."""
        capacity = self.runner.num_blocks * self.args.block_size
        if capacity >= self.max_model_len:
            return
        if self.args.max_model_len is not None:
            raise ValueError(
                f"max_model_len: {self.max_model_len} tokens do not fit the KV cache of {self.runner.num_blocks} "
                f"blocks x {self.args.block_size} = {capacity} tokens; lower max_model_len or give the cache more memory"
            )
        logger.warning("max_model_len lowered from %d to %d tokens, what the KV cache holds", self.max_model_len, capacity)
        self.max_model_len = capacity

    def get_tokenizer(self):
        return self.tokenizer

    # --- requests -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        """Queue a request: sampled (SamplingParams) or beam search (BeamSearchParams).
        Raises ValueError (naming the field) for input that can never run; the engine's
        other requests are unaffected."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"params: expected SamplingParams or BeamSearchParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self.requests or any(o.request_id == request_id for o in self._aborted_outputs):
            # An aborted id is free again once step() has returned its final output.
            raise ValueError(f"request_id: {request_id!r} is already in the engine")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        text, token_ids = self._tokenize(prompt)
        beam = params if isinstance(params, BeamSearchParams) else None
        if beam is not None:
            # What every beam shares; the sampler never sees beams.
            params = SamplingParams(temperature=0.0, max_tokens=beam.max_tokens, ignore_eos=beam.ignore_eos)
        self._check_request(token_ids, params)
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.time()),
            priority=priority,
            output_kind=output_kind,
        )
        if beam is not None:
            request.beam_search = BeamSearch(beam, len(token_ids), self.eos_token_ids)
        first = self._new_sequence(request, 0)
        request.seqs.append(first)
        if request.beam_search is not None:
            request.beam_search.live.append(first)
        self.requests[request_id] = request
        self.scheduler.add(first)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or len(prompt) != 1:
                raise ValueError(f"prompt: a dict needs exactly one of 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in token_ids
                ):
                    raise ValueError("prompt_token_ids: must be a list of integers")
                return None, list(token_ids)
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: expected a string or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("prompt: text prompts need a tokenizer (the engine was built with skip_tokenizer_init)")
        return prompt, self.tokenizer.encode(prompt)

    def _check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        check_prompt_fits(len(token_ids), None, self.max_model_len)
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        bad = [t for t in params.stop_token_ids or () if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if self.tokenizer is None and params.stop_strings:
            raise ValueError("stop: stop strings need a tokenizer (the engine was built with skip_tokenizer_init)")

    def _new_sequence(self, request: Request, index: int, parent: Sequence | None = None) -> Sequence:
        params = request.params
        seq = Sequence(request=request, index=index, token_ids=list(request.prompt_token_ids))
        if parent is not None:
            seq.token_ids = list(parent.token_ids)
            seq.output_token_ids = list(parent.output_token_ids)
            seq.cumulative_logprob = parent.cumulative_logprob
        if params.logprobs is not None:
            seq.logprobs = []
        if params.seed is not None:
            # Each of the n outputs gets its own stream, the same whatever else is batched.
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
        if self.tokenizer is not None and request.beam_search is None:
            # Beams are decoded once, when the search picks its best.
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
        return seq

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now and free their KV blocks; unknown or finished ids are ignored.
        The next step() returns each one's final output, finish_reason "abort"; until then
        the id cannot be reused."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.remove(seq)
                    self._mark_finished(seq, "abort")
            request.aborted = True
            request.metrics.finished_time = time.time()
            self.counters.requests_aborted += 1
            self._aborted_outputs.append(request.output())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- the loop -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the outputs of requests that produced tokens or
        finished (FINAL_ONLY requests: only when they finish)."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        if not self.scheduler.has_unfinished():
            return outputs
        sched = self.scheduler.schedule()
        if sched.is_empty and not self.scheduler.running:
            raise RuntimeError("the scheduler could not run anything although requests wait (a pagedq bug)")
        self.counters.steps += 1
        now = time.time()
        for item in sched.scheduled:
            if item.seq.request.metrics.first_scheduled_time is None:
                item.seq.request.metrics.first_scheduled_time = now

        tables = [self.block_manager.block_table(item.seq.seq_id) for item in sched.scheduled]
        logits = self.runner.execute(sched, tables)
        sampling = [item for item in sched.scheduled if item.completes_prompt]
        for item in sched.scheduled:
            self._advance(item)

        rows: list[Sequence] = []
        row_of_logits: list[int] = []
        beams: list[tuple[Sequence, int]] = []
        for logits_row, item in enumerate(sampling):
            if item.seq.request.beam_search is not None:
                beams.append((item.seq, logits_row))
                continue
            seqs = [item.seq] + self._fork_if_first_sample(item.seq)
            rows += seqs
            row_of_logits += [logits_row] * len(seqs)

        touched: dict[str, Request] = {}
        if beams:
            for request in self._report_beams(beams, logits):
                touched[request.request_id] = request
        if rows:
            sampled = self.sampler(logits[torch.tensor(row_of_logits, device=logits.device)], rows)
            for i, seq in enumerate(rows):
                self._append(seq, sampled.token_ids[i], sampled.logprobs[i], sampled.top_logprobs[i], now)
                touched[seq.request.request_id] = seq.request
        for request in touched.values():
            finished = request.is_finished
            if finished:
                request.metrics.finished_time = time.time()
                del self.requests[request.request_id]
                self.counters.requests_finished += 1
            if finished or request.output_kind is RequestOutputKind.CUMULATIVE:
                outputs.append(request.output())
        return outputs

    def _advance(self, item: ScheduledSequence) -> None:
        seq = item.seq
        start = seq.num_computed_tokens
        seq.num_computed_tokens += item.num_new_tokens
        self.counters.tokens_computed += item.num_new_tokens
        self.counters.prompt_tokens_computed += max(0, min(seq.num_computed_tokens, len(seq.prompt_token_ids)) - start)
        self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    def _fork_if_first_sample(self, parent: Sequence) -> list[Sequence]:
        """Parallel sampling: when the prompt is done, the other n - 1 outputs branch off
        the first, sharing its blocks; all n draw their first token from the same logits."""
        request = parent.request
        if request.branched:
            return []
        request.branched = True
        children = [self._new_sequence(request, index, parent) for index in range(1, request.params.n)]
        request.seqs += children
        self.scheduler.fork(parent, children)
        return children

    def _report_beams(self, beams: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[Request]:
        """Each beam hands in its most likely next tokens; a request whose every live beam
        has reported moves to its next beams. Returns the requests that finished."""
        rows = torch.tensor([row for _, row in beams], device=logits.device)
        width = max(seq.request.beam_search.num_candidates for seq, _ in beams)
        top = logits[rows].log_softmax(dim=-1).topk(min(width, logits.shape[1]), dim=-1)
        finished = []
        for (seq, _), values, ids in zip(beams, top.values.tolist(), top.indices.tolist()):
            search = seq.request.beam_search
            k = search.num_candidates
            if search.report(seq, seq.output_token_ids, seq.cumulative_logprob, list(zip(ids[:k], values[:k]))):
                if self._next_beams(seq.request):
                    finished.append(seq.request)
        return finished

    def _next_beams(self, request: Request) -> bool:
        """Branch the chosen beams off their parents and drop the old ones; True when the
        search is over and the request has its final outputs."""
        search = request.beam_search
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.time()
        proposals = search.advance(self.max_model_len)
        children = []
        for index, proposal in enumerate(proposals):
            child = self._new_sequence(request, index, proposal.parent)
            self.scheduler.fork(proposal.parent, [child])
            child.append_token(proposal.token_id)
            child.cumulative_logprob = proposal.cum_logprob
            children.append(child)
        for old in search.live:
            # Usually parked in the running queue, but preemption may have moved it since it reported.
            self.scheduler.remove(old)
            old.status = SequenceStatus.FINISHED
        self.counters.generation_tokens += len(children)
        request.branched = True
        request.seqs = search.live = children
        if children:
            return False
        request.final_outputs = [
            CompletionOutput(
                index=index,
                text=self.tokenizer.decode(h.output_token_ids, skip_special_tokens=True) if self.tokenizer else "",
                token_ids=h.output_token_ids,
                cumulative_logprob=h.cum_logprob,
                logprobs=None,
                finish_reason="stop" if h.ends_with_eos else "length",
            )
            for index, h in enumerate(search.best())
        ]
        return True

    def _append(self, seq: Sequence, token: int, logprob: float, top_logprobs, now: float) -> None:
        request = seq.request
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        seq.append_token(token)
        seq.cumulative_logprob += logprob
        self.counters.generation_tokens += 1
        if seq.logprobs is not None and top_logprobs is not None:
            if seq.detokenizer is not None:
                for token_id, entry in top_logprobs.items():
                    entry.decoded_token = seq.detokenizer.decode_token(token_id)
            seq.logprobs.append(top_logprobs)
        stop_string = seq.detokenizer.update([token]) if seq.detokenizer is not None else None
        reason = self._stop_reason(seq, token, stop_string)
        if reason is not None:
            self.scheduler.finish(seq)
            self._mark_finished(seq, *reason)

    def _stop_reason(self, seq: Sequence, token: int, stop_string: str | None):
        params = seq.params
        num_output = len(seq.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return ("stop", None)
            if params.stop_token_ids and token in params.stop_token_ids:
                return ("stop", token)
            if stop_string is not None:
                return ("stop", stop_string)
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return ("length", None)
        if seq.num_tokens >= self.max_model_len:
            return ("length", None)
        return None

    @staticmethod
    def _mark_finished(seq: Sequence, finish_reason: str, stop_reason: int | str | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason
        seq.stop_reason = stop_reason
        if seq.detokenizer is not None:
            seq.detokenizer.finish()

    # --- observability ------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        bm, sched, c = self.block_manager, self.scheduler, self.counters
        return {
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "num_swapped": sched.num_swapped,
            "num_total_blocks": bm.num_total_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_cached_blocks": bm.gpu.num_cached,
            "num_swapped_blocks": bm.num_swapped_blocks,
            "kv_cache_usage": bm.usage,
            "prefix_cache_queries": bm.prefix_stats.queries,
            "prefix_cache_hits": bm.prefix_stats.hits,
            "num_preemptions_recompute": sched.preemptions.recompute,
            "num_preemptions_swap": sched.preemptions.swap,
            "prompt_tokens_computed": c.prompt_tokens_computed,
            "tokens_computed": c.tokens_computed,
            "generation_tokens": c.generation_tokens,
            "requests_finished": c.requests_finished,
            "requests_aborted": c.requests_aborted,
            "steps": c.steps,
        }


def _eos_token_ids(model: str, hf_config, tokenizer) -> set[int]:
    """EOS ids from the generation config (which may list several), the model config and
    the tokenizer, as transformers' generate gathers them."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        candidates = [GenerationConfig.from_pretrained(model, local_files_only=True).eos_token_id]
    except OSError:
        candidates = []
    candidates += [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
