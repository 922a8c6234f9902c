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
from pagedq.request_rules import check_width, unencodable_text
from pagedq.sampling_params import SamplingParams
from pagedq.sequence import Request, Sequence, SequenceStatus
from scheduler import ScheduledSequence, Scheduler, SchedulerConfig, SchedulerOutput
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
    requests_failed: int = 0
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
        # Final outputs of requests that failed during this step, returned by it.
        self._failed_outputs: list[RequestOutput] = []
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

    def set_step_timings(self, timings) -> None:
        """Record where each step's host time goes (pagedq.core.step_timings); None stops."""
        self.runner.step_timings = timings

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
        self._check_request(token_ids, params, beam)
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
        if (why := unencodable_text(prompt)) is not None:
            raise ValueError(f"prompt: {why}")
        if self.tokenizer is None:
            raise ValueError("prompt: text prompts need a tokenizer (the engine was built with skip_tokenizer_init)")
        return prompt, self.tokenizer.encode(prompt)

    def _check_request(
        self, token_ids: list[int], params: SamplingParams, beam: BeamSearchParams | None = None
    ) -> None:
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        check_prompt_fits(len(token_ids), None, self.max_model_len)
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        bad = [t for t in params.stop_token_ids or () if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if beam is not None:
            check_width("beam_width", beam.beam_width, self.args.max_num_seqs)
        else:
            check_width("n", params.n, self.args.max_num_seqs)
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs: {params.logprobs} alternatives, more than the vocabulary's {self.vocab_size} tokens")
        if self.tokenizer is None and params.stop_strings:
            raise ValueError("stop: stop strings need a tokenizer (the engine was built with skip_tokenizer_init)")

    def _new_sequence(self, request: Request, index: int, parent: Sequence | None = None) -> Sequence:
        params = request.params
        seq = Sequence(request=request, index=index, token_ids=list(request.prompt_token_ids))
        if parent is not None:
            seq.token_ids = list(parent.token_ids)
            seq.output_token_ids = list(parent.output_token_ids)
            seq.cumulative_logprob = parent.cumulative_logprob
        elif params.logprobs is not None or request.beam_search is not None:
            # Beams rank by it; other requests carry it only when they ask for logprobs (vLLM V1).
            seq.cumulative_logprob = 0.0
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
        finished (FINAL_ONLY requests: only when they finish).

        Whatever one request causes to throw (its forward, sampling, detokenization, stop
        check) fails that request alone, its output finished with `error` set; the step
        carries on for the others (see `_fail_request`)."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        if not self.scheduler.has_unfinished():
            return outputs
        timings = self.runner.step_timings
        if timings is not None:
            timings.begin()
        sched = self.scheduler.schedule()
        if timings is not None:
            timings.shape(len(sched.scheduled), sum(item.num_new_tokens for item in sched.scheduled))
            timings.phase("schedule")
        if sched.is_empty and not self.scheduler.running:
            # add_request refuses what can never be scheduled, so this is a pagedq bug; the
            # request that blocks the queue fails rather than every request of the engine.
            stuck = self.scheduler.next_in_line()
            message = "the scheduler could not run this request (a pagedq bug)"
            logger.error("request %s: %s", stuck.request.request_id, message)
            self._fail_request(stuck.request, message)
            return outputs + self._take_failed()
        self.counters.steps += 1
        now = time.time()
        for item in sched.scheduled:
            if item.seq.request.metrics.first_scheduled_time is None:
                item.seq.request.metrics.first_scheduled_time = now

        logits = self._execute(sched)
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
            sampled = self._sample(logits[torch.tensor(row_of_logits, device=logits.device)], rows)
            if timings is not None:
                timings.phase("sample")
            sampled_at = time.time()  # a token exists once its step's forward and sampling are done
            for seq, (token, logprob, top_logprobs) in sampled:
                request = seq.request
                if request.error is not None:
                    continue  # another of its sequences failed it in this loop
                try:
                    self._append(seq, token, logprob, top_logprobs, sampled_at)
                except Exception as exc:
                    self._fail_request(request, f"processing its new token failed: {exc!r}", exc)
                    continue
                touched[request.request_id] = request
        for request in touched.values():
            if request.error is not None:
                continue
            finished = request.is_finished
            if finished:
                request.metrics.finished_time = time.time()
                del self.requests[request.request_id]
                self.counters.requests_finished += 1
            if finished or request.output_kind is RequestOutputKind.CUMULATIVE:
                outputs.append(request.output())
        if timings is not None:
            timings.phase("update")
            timings.end()
        return outputs + self._take_failed()

    def _execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """The step's forward. Should it throw, each request's sequences run again alone:
        a request whose own forward throws fails, and the step goes on without it. When
        every request fails alone too, the fault is not any one request's: it is raised."""
        tables = [self.block_manager.block_table(item.seq.seq_id) for item in sched.scheduled]
        try:
            return self.runner.execute(sched, tables)
        except Exception as exc:
            groups: dict[str, list[int]] = {}
            for i, item in enumerate(sched.scheduled):
                groups.setdefault(item.seq.request.request_id, []).append(i)
            if len(groups) == 1:
                raise
            logger.warning("a step's forward failed (%r); running each of its %d requests alone", exc, len(groups))
            # The block moves ran before the forward did; each retry is only a forward.
            rows: dict[int, torch.Tensor] = {}  # scheduled index -> its logits row
            failed: list[tuple[Request, Exception]] = []
            for indices in groups.values():
                alone = SchedulerOutput(scheduled=[sched.scheduled[i] for i in indices])
                try:
                    block = self.runner.execute(alone, [tables[i] for i in indices])
                except Exception as own:
                    failed.append((sched.scheduled[indices[0]].seq.request, own))
                    continue
                rows.update(zip([i for i in indices if sched.scheduled[i].completes_prompt], block))
            if len(failed) == len(groups):
                raise
            for request, own in failed:
                self._fail_request(request, f"its forward pass failed: {own!r}", own)
            sched.scheduled = [item for item in sched.scheduled if item.seq.request.error is None]
            if not rows:
                return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
            return torch.stack([rows[i] for i in sorted(rows)])

    def _sample(self, logits: torch.Tensor, rows: list[Sequence]) -> list[tuple[Sequence, tuple[int, float, Any]]]:
        """(sequence, (token, logprob, top logprobs)) for each row whose request did not fail.
        Should the batched sampler throw, each request's rows are sampled alone (seeded
        rows from where their generators stood), and a request that throws alone fails.
        A token outside the vocabulary fails its request too: it would fail the next
        step's forward for everyone."""
        seeded = [(seq.generator, seq.generator.get_state()) for seq in rows if seq.generator is not None]
        try:
            groups = [(list(range(len(rows))), self.sampler(logits, rows))]
        except Exception as exc:
            logger.warning("sampling %d rows failed (%r); sampling each request alone", len(rows), exc)
            for generator, state in seeded:
                generator.set_state(state)
            by_request: dict[str, list[int]] = {}
            for i, seq in enumerate(rows):
                by_request.setdefault(seq.request.request_id, []).append(i)
            groups = []
            for indices in by_request.values():
                try:
                    groups.append((indices, self.sampler(logits[indices], [rows[i] for i in indices])))
                except Exception as own:
                    self._fail_request(rows[indices[0]].request, f"sampling failed: {own!r}", own)
        results = []
        for indices, out in groups:
            for j, i in enumerate(indices):
                seq, token = rows[i], out.token_ids[j]
                if not 0 <= token < self.vocab_size:
                    self._fail_request(seq.request, f"sampling produced token id {token}, outside the vocabulary")
                elif seq.request.error is None:
                    results.append((seq, (token, out.logprobs[j], out.top_logprobs[j])))
        return [(seq, result) for seq, result in results if seq.request.error is None]

    def _fail_request(self, request: Request, error: str, exc: BaseException | None = None) -> None:
        """Something this request caused threw: it finishes now with `error` (each
        unfinished sequence's finish_reason "error"), its blocks are freed, and the next
        output of step() is its last."""
        if request.error is not None or request.request_id not in self.requests:
            return
        logger.warning("request %s failed alone: %s", request.request_id, error, exc_info=exc)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "error"
        request.error = error
        request.metrics.finished_time = time.time()
        del self.requests[request.request_id]
        self.counters.requests_failed += 1
        try:
            output = request.output()
        except Exception:
            # What threw may be a detokenizer, and reading its text throws again: the text goes with it.
            for seq in request.seqs:
                seq.detokenizer = None
            output = request.output()
        self._failed_outputs.append(output)

    def _take_failed(self) -> list[RequestOutput]:
        failed, self._failed_outputs = self._failed_outputs, []
        return failed

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
            if seq.request.error is not None:
                continue
            try:
                if search.report(seq, seq.output_token_ids, seq.cumulative_logprob, list(zip(ids[:k], values[:k]))):
                    if self._next_beams(seq.request):
                        finished.append(seq.request)
            except Exception as exc:
                self._fail_request(seq.request, f"advancing its beams failed: {exc!r}", exc)
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

    def _append(self, seq: Sequence, token: int, logprob: float | None, top_logprobs, now: float) -> None:
        request = seq.request
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        seq.append_token(token)
        if logprob is not None:
            seq.cumulative_logprob += logprob
        self.counters.generation_tokens += 1
        if seq.logprobs is not None and top_logprobs is not None:
            if seq.detokenizer is not None:
                for token_id, entry in top_logprobs.items():
                    entry.decoded_token = seq.detokenizer.decode_token(token_id)
            seq.logprobs.append(top_logprobs)
        reason = self._token_stop_reason(seq, token)
        if seq.detokenizer is not None:
            # A stop string found in the text ends the sequence even at its length limit.
            stop_string = seq.detokenizer.update([token], stop_terminated=reason is not None and reason[0] == "stop")
            if stop_string is not None:
                reason = ("stop", stop_string)
        if reason is not None:
            self.scheduler.finish(seq)
            self._mark_finished(seq, *reason)

    def _token_stop_reason(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
        """vLLM V1's check_stop, in its order: the length limits first (so a stop token
        that is also the last allowed one finishes "length" and keeps its text), then eos
        unless ignore_eos, then stop_token_ids (the sampler keeps both out before
        min_tokens)."""
        params = seq.params
        if (params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            return ("length", None)
        if not params.ignore_eos and token in self.eos_token_ids:
            return ("stop", None)
        if params.stop_token_ids and token in params.stop_token_ids:
            return ("stop", token)
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
            "requests_failed": c.requests_failed,
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
