"""EngineCore: continuous batching over a paged KV cache, as token ids in and token ids out.

The core owns the scheduler, the block manager and the model runner (the device side).
It takes requests as token ids (`pagedq.core.messages.AddRequest`) and each `step()`
returns what the step made known: each sequence's new token ids, finishes by length, eos
or stop token, requests failed alone. Text, stop strings and `RequestOutput`s are the
front's (pagedq.front); the core never sees a tokenizer.

One step: schedule → launch (block moves, one forward, sampling, all queued on the
device) → collect a launched step's sampled ids → append them, check the length, eos and
stop tokens, free what finished.

Overlapped steps (`EngineArgs.async_scheduling`, on by default on CUDA). The core keeps
up to two steps in flight: it schedules and launches step N+1 while the device still
runs step N, and only then waits for step N's ids. Each sequence sampled by step N
carries a pending token (see pagedq.core.request): step N+1 computes its position with
the id read from step N's sampled ids on the device, and the host appends it a step
later. A sequence that ends at step N (eos, a stop token) has its step-N+1 token thrown
away: the one discarded token overlap costs. A sequence whose last allowed token is in
flight is not scheduled again. Requests that need their tokens on the host before their
next step sit out the step after each of theirs (`CoreRequest.sync`: beam search, which
picks the next beams on the host, and penalties, counted on the host); n > 1 requests
branch when their prompt's last chunk is scheduled, so their first tokens are all
sampled from that step. Seeded sampling and logprobs need nothing from the host and run
ahead like the rest. A structured output's grammar needs its last token only before its
sampling: a step with grammar rows collects the step in flight early, after queuing its
own forward (`_grammar_masks`, pagedq.core.structured_outputs). Without overlap (the CPU default: there the device is the host, and
nothing runs beside it) each step is collected as soon as it is launched.

Isolation: whatever one request causes to throw (its forward, its sampling, its beams, a
token outside the vocabulary) fails that request alone; the step goes on for the others
(`_forward`, `_sample`, `_fail_request`). A step that raises for every request raises;
the core then drops every request, so the next caller finds it empty. Under tensor
parallelism (`EngineArgs.tensor_parallel_size`, worker.tp) a step that throws, or a rank
that dies, raises `TensorParallelError` and the engine is dead: the other ranks were left
inside that step's collectives, so no request can be retried alone.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import torch

from blockmgr import BlockManager
from pagedq.beam_search import BeamSearch
from pagedq.config import EngineArgs
from pagedq.core.messages import AddRequest, BeamHypothesis, CoreInfo, CoreOutputs
from pagedq.core.request import CoreRequest, Sequence, SequenceStatus
from pagedq.core.structured_outputs import GrammarCompiler, TokenBitmask, new_matcher
from pagedq.model_info import load_hf_config, resolve_max_model_len
from scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from worker.host_copy import HostCopy, to_device
from worker.input_batch import StepPlan
from worker.model_runner import ModelRunner
from worker.sampler import NO_TOKEN_ALLOWED, SamplerOutput, logprob_tensors
from worker.tp.leader import TensorParallelError

logger = logging.getLogger(__name__)


@dataclass
class EngineCounters:
    prompt_tokens_computed: int = 0  # prompt positions whose KV was computed (cache hits excluded)
    tokens_computed: int = 0  # every position computed, recomputation after preemption included
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    steps: int = 0


@dataclass
class _LaunchedStep:
    """A step on the device: its sampling rows, and how their ids come back."""

    step_id: int
    rows: list[Sequence]  # the sampler's rows, in order
    sample: object  # DeviceSample, or _HostSample when sampling fell back to one request at a time
    beams: list[Sequence] = field(default_factory=list)
    beam_top: HostCopy | None = None  # (top logprobs, their ids), a row per beam
    prompt_logprobs: _PromptLogprobs | None = None


@dataclass
class _PromptLogprobs:
    """A step's prompt positions whose next prompt token's logprob was asked for (prompt_logprobs)."""

    segments: list[tuple[CoreRequest, int]] = field(default_factory=list)  # (request, positions), in logits order
    targets: list[int] = field(default_factory=list)  # the next prompt token of each position
    copy: HostCopy | None = None  # (target logprob, top values, top ids, target rank), a row per position


class _HostSample:
    """Sampling results already on the host (the fallback path samples synchronously)."""

    def __init__(self, output: SamplerOutput, device: torch.device):
        self.output = output
        self.token_ids = torch.tensor(output.token_ids, dtype=torch.int64, device=device)

    def to_host(self) -> SamplerOutput:
        return self.output


class EngineCore:
    def __init__(self, args: EngineArgs, eos_token_ids: set[int]):
        self.args = args
        hf_config = load_hf_config(args.model)
        self.max_model_len = resolve_max_model_len(hf_config, args.max_model_len)
        self.runner = ModelRunner.create(args, hf_config, self.max_model_len, set(eos_token_ids))
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
        self.device = self.runner.device
        self._eos_token_ids = set(eos_token_ids)
        self.requests: dict[int, CoreRequest] = {}
        self.counters = EngineCounters()
        overlap = args.async_scheduling if args.async_scheduling is not None else (
            self.device.type == "cuda" and args.tensor_parallel_size == 1  # see EngineArgs.async_scheduling's check
        )
        self.max_steps_in_flight = 2 if overlap else 1
        self._in_flight: deque[_LaunchedStep] = deque()
        self._step_id = 0
        self._out = CoreOutputs()
        # Failures found between steps, for the next step's outputs.
        self._reported: list[tuple[int, str]] = []
        # Structured outputs, built with the first request that has one.
        self._grammars: GrammarCompiler | None = None
        self._bitmask: TokenBitmask | None = None
        # Requests whose grammar is compiling, with their first sequence: not yet scheduled.
        self._compiling: list[tuple[CoreRequest, Sequence, Future]] = []

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

    def info(self) -> CoreInfo:
        return CoreInfo(
            vocab_size=self.vocab_size, max_model_len=self.max_model_len, device=str(self.device),
            num_gpu_blocks=self.block_manager.num_total_blocks, num_cpu_blocks=self.runner.num_cpu_blocks,
            block_size=self.args.block_size, attention_backend=self.runner.attention.name,
            max_steps_in_flight=self.max_steps_in_flight,
        )

    def set_eos_token_ids(self, token_ids: set[int]) -> None:
        """Applies to requests added from now on (and to min_tokens masking at once)."""
        self._eos_token_ids = set(token_ids)
        self.runner.sampler.eos_token_ids = set(token_ids)

    @property
    def step_timings(self):
        return self.runner.step_timings

    @step_timings.setter
    def step_timings(self, timings) -> None:
        self.runner.step_timings = timings

    # --- requests -----------------------------------------------------------------------

    def add_request(self, message: AddRequest) -> None:
        """Queue a request the front validated (pagedq.front.input_processor)."""
        if message.request_id in self.requests:
            raise ValueError(f"request {message.request_id} is already in the engine core")
        beam = None
        if message.beam is not None:
            beam = BeamSearch(message.beam, len(message.prompt_token_ids), self._eos_token_ids)
        request = CoreRequest(
            message.request_id, message.prompt_token_ids, message.params, arrival_time=message.arrival_time,
            priority=message.priority, eos_token_ids=self._eos_token_ids, max_model_len=self.max_model_len,
            beam_search=beam, stream=message.stream, report_every_s=message.report_every_s,
            bad_words_token_ids=message.bad_words_token_ids,
        )
        first = self._new_sequence(request, 0)
        request.seqs.append(first)
        if beam is not None:
            beam.live.append(first)
        self.requests[request.request_id] = request
        if message.params.structured_outputs is not None:
            self._compiling.append((request, first, self._grammar_compiler().submit(message.params.structured_outputs)))
        else:
            self.scheduler.add(first)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.args.model, self.vocab_size, self._eos_token_ids)
            self._bitmask = TokenBitmask(self.vocab_size, self.device)
        return self._grammars

    def _admit_compiled(self, wait_s: float) -> None:
        """Schedule the requests whose grammar is ready (waiting up to `wait_s` for one when
        nothing else runs); a grammar that failed to compile fails its request alone."""
        if wait_s > 0:
            wait([future for _, _, future in self._compiling], timeout=wait_s, return_when=FIRST_COMPLETED)
        still: list[tuple[CoreRequest, Sequence, Future]] = []
        for request, first, future in self._compiling:  # (abort_requests takes aborted ones out)
            if not future.done():
                still.append((request, first, future))
                continue
            error = future.exception()
            if error is not None:
                self._fail_request(request, str(error), invalid_input=True)
                continue
            request.grammar = future.result()
            first.grammar = new_matcher(request.grammar)
            self.scheduler.add(first)
        self._compiling = still

    def _new_sequence(self, request: CoreRequest, index: int, parent: Sequence | None = None) -> Sequence:
        seq = Sequence(request, index, list(parent.token_ids if parent is not None else request.prompt_token_ids))
        if parent is not None:
            seq.cumulative_logprob = parent.cumulative_logprob
        if request.grammar is not None:
            # n > 1 branches before any output token: each output starts the grammar afresh.
            seq.grammar = new_matcher(request.grammar)
        if request.params.seed is not None:
            # Each of the n outputs gets its own stream, the same whatever else is batched.
            seq.generator = torch.Generator(device=self.device).manual_seed(request.params.seed + index)
        return seq

    def abort_requests(self, request_ids: list[int]) -> None:
        """Stop requests now and free their KV blocks; unknown or finished ids are ignored.
        A token of theirs still in flight is dropped when its step is collected."""
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.grammar is None and self._compiling:
                self._compiling = [entry for entry in self._compiling if entry[0] is not request]
            self._end_sequences(request)
            self.counters.requests_aborted += 1

    def report_failure(self, request_id: int, error: str) -> None:
        """A request that could not even be added: the next step's outputs say so."""
        self._reported.append((request_id, error))

    def stop_sequences(self, sequences: list[tuple[int, int]]) -> None:
        """The front ended these sequences (a stop string): free them now. A request whose
        every sequence has ended is done."""
        for request_id, index in sequences:
            request = self.requests.get(request_id)
            if request is None:
                continue
            for seq in request.seqs:
                if seq.index == index and not seq.is_finished:
                    self.scheduler.finish(seq)
            self._retire_if_done(request)

    def _retire_if_done(self, request: CoreRequest) -> None:
        if request.request_id in self.requests and (request.branched or request.width == 1) and all(
            seq.is_finished for seq in request.seqs
        ):
            del self.requests[request.request_id]
            self.counters.requests_finished += 1

    def shutdown(self) -> None:
        """Stops the model runner's other ranks, if any, and the grammar compiler's thread."""
        self.runner.shutdown()
        if self._grammars is not None:
            self._grammars.close()

    def check_alive(self) -> None:
        """Between steps: raises TensorParallelError if one of the other ranks has died."""
        self.runner.check_alive()

    def has_work(self) -> bool:
        """Requests to run, or a step still in flight to collect."""
        return bool(self.requests) or bool(self._in_flight)

    # --- the loop -----------------------------------------------------------------------

    def step(self) -> CoreOutputs:
        """Launch a step if there is room and work, collect the oldest step in flight when
        the queue is full or nothing could be launched; returns what became known."""
        self._out = out = CoreOutputs()
        if self._reported:
            out.failed, self._reported = self._reported, []
        if self._compiling:
            # Nothing else to do: wait a little for a grammar instead of spinning.
            idle = not self._in_flight and not self.scheduler.has_unfinished()
            self._admit_compiled(0.005 if idle else 0.0)
        try:
            with torch.inference_mode():
                launched = False
                if len(self._in_flight) < self.max_steps_in_flight and self.scheduler.has_unfinished():
                    launched = self._schedule_and_launch()
                if self._in_flight and (not launched or len(self._in_flight) >= self.max_steps_in_flight):
                    self._collect(self._in_flight.popleft())
        except BaseException:
            # Not any one request's fault: the engine's state cannot be trusted, so every
            # request goes, and the caller finds the core empty.
            self.drop_everything()
            raise
        out.timestamp = time.time()
        return out

    def drop_everything(self) -> None:
        self._in_flight.clear()
        self.runner.last_sampled = None
        self.abort_requests(list(self.requests))

    def _schedule_and_launch(self) -> bool:
        timings = self.runner.step_timings
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if sched.swap_out:
                with torch.inference_mode():
                    self.runner.move_blocks(sched)  # preempted by swap with nothing else to run
            if not self.scheduler.running and not self._in_flight and self.scheduler.has_unfinished():
                # add_request refuses what can never be scheduled, so this is a pagedq bug;
                # the request that blocks the queue fails rather than every request.
                stuck = self.scheduler.next_in_line().request
                logger.error("request %s: the scheduler could not run it (a pagedq bug)", stuck.request_id)
                self._fail_request(stuck, "the scheduler could not run this request (a pagedq bug)")
            return False
        if timings is not None:
            timings.shape(len(sched.seqs), sched.num_tokens)
            timings.phase("schedule")
        self._step_id += 1
        self.counters.steps += 1
        failures = len(self._out.failed)
        now = time.time()
        for seq in sched.admitted:
            request = seq.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                self._out.scheduled.append((request.request_id, now, request.num_cached_tokens))
        plan, rows, logits_rows, beams, forks, filled, prompt_logprobs = self._plan(sched)
        if sched.swap_out or sched.block_copies or sched.swap_in:
            self.runner.move_blocks(sched)
        logits = self._forward(sched, plan)
        if prompt_logprobs is not None:
            num_rows = len(plan.logits_of)
            self._queue_prompt_logprobs(logits[num_rows:], prompt_logprobs)
            logits = logits[:num_rows]
        # Blocks that this step fills join the prefix cache now that its forward is
        # launched (never before: a block of a request whose forward failed must not be
        # found by anyone).
        bm = self.block_manager
        for seq in filled:
            if seq.status is SequenceStatus.RUNNING:
                bm.cache_full_blocks(seq.uid, seq.token_ids, min(seq.num_computed_tokens, len(seq.token_ids)))
        for parent, logits_row in forks:
            if parent.status is SequenceStatus.RUNNING:
                for child in self._fork(parent):
                    child.num_pending, child.sample_step, child.sample_row = 1, self._step_id, len(rows)
                    rows.append(child)
                    logits_rows.append(logits_row)
        if len(self._out.failed) != failures:  # some request failed alone in its forward
            kept = [i for i, seq in enumerate(rows) if seq.status is SequenceStatus.RUNNING]
            rows, logits_rows = [rows[i] for i in kept], [logits_rows[i] for i in kept]
            self._renumber(rows)
            failures = len(self._out.failed)
        masks = None
        # (No scan of the rows until a request has brought a grammar.)
        if self._grammars is not None and any(seq.grammar is not None for seq in rows):
            masks = self._grammar_masks(rows)
        # A request that fails alone in its sampling keeps its rows (ended sequences, their
        # ids unread), so every row stays where the sampled ids have it.
        sample = self._sample(logits, rows, logits_rows, masks)
        if timings is not None:
            timings.phase("sample")
        self.runner.last_sampled = sample.token_ids
        launched = _LaunchedStep(self._step_id, rows, sample, prompt_logprobs=prompt_logprobs)
        beams = [(seq, row) for seq, row in beams if seq.status is SequenceStatus.RUNNING]
        if beams:
            width = max(seq.request.beam_search.num_candidates for seq, _ in beams)
            index = to_device([row for _, row in beams], torch.int64, logits.device)
            launched.beams = [seq for seq, _ in beams]
            launched.beam_top = HostCopy(list(self.runner.top_logprobs(logits[index], width)))
        self._in_flight.append(launched)
        return True

    def _grammar_masks(self, rows: list[Sequence]) -> tuple[torch.Tensor, list[int]]:
        """The step's token bitmask (a row per sampling row) and the rows it constrains. A
        grammar must have seen a sequence's last token, which may be in the step still in
        flight: that step is collected now, its forward queued behind it (see
        pagedq.core.structured_outputs), so the device has this step's forward to run while
        the host reads the tokens and fills the masks."""
        if self._in_flight:
            self._collect(self._in_flight.popleft())
        matchers = [seq.grammar if seq.status is SequenceStatus.RUNNING else None for seq in rows]
        constrained = [i for i, matcher in enumerate(matchers) if matcher is not None]
        return self._bitmask.fill(matchers), constrained

    def _renumber(self, rows: list[Sequence]) -> None:
        """After rows were dropped: each sequence's pending token sits at its new row."""
        for row, seq in enumerate(rows):
            seq.sample_row = row

    def _plan(self, sched: SchedulerOutput):
        """One pass over the scheduled sequences: the runner's StepPlan; who samples from
        which logits row (the sequences, their rows); beams' (sequence, row) pairs; n > 1
        parents that branch this step; the sequences whose step fills a block. Each
        sequence is advanced by what the step computes (the step is committed from here:
        if its forward fails for a request, that request ends), and each that samples
        carries the pending token, at its row of this step's sampled ids."""
        rows_of = self.block_manager.rows
        block_size = self.args.block_size
        rows: list[int] = []
        starts: list[int] = []
        token_ids: list[int] = []
        pending_at: list[int] = []
        pending_from: list[int] = []
        logits_of: list[int] = []
        samplers: list[Sequence] = []
        sampler_rows: list[int] = []
        beams: list[tuple[Sequence, int]] = []
        forks: list[tuple[Sequence, int]] = []
        filled: list[Sequence] = []
        extra_logits: list[int] = []
        prompt_logprobs: _PromptLogprobs | None = None
        step_id = self._step_id
        previous_step = step_id - 1
        prompt_computed = 0
        i = 0
        for seq, num_new in zip(sched.seqs, sched.num_new_tokens):
            start = seq.num_computed_tokens
            base = len(token_ids)
            rows.append(rows_of[seq.uid])
            starts.append(start)
            known = seq.token_ids
            end = start + num_new
            num_known = len(known)
            if end <= num_known:
                if num_new == 1:
                    token_ids.append(known[start])
                else:
                    token_ids += known[start:end]
            else:
                # Only a decode reads a token still in flight: the one the last step sampled.
                if num_new != 1 or seq.sample_step != previous_step:
                    raise RuntimeError(f"sequence {seq.uid}: {num_new} new tokens past its known ones (a pagedq bug)")
                pending_at.append(len(token_ids))
                pending_from.append(seq.sample_row)
                token_ids.append(0)
            if start < seq.num_prompt_tokens:
                prompt_computed += min(end, seq.num_prompt_tokens) - start
                request = seq.request
                first = max(start, request.prompt_logprobs_done)
                upto = min(end, seq.num_prompt_tokens - 1)
                if upto > first:  # positions whose next prompt token's logprob is owed
                    if prompt_logprobs is None:
                        prompt_logprobs = _PromptLogprobs()
                    extra_logits.extend(range(base + first - start, base + upto - start))
                    prompt_logprobs.targets += seq.prompt_token_ids[first + 1 : upto + 1]
                    prompt_logprobs.segments.append((request, upto - first))
                    request.prompt_logprobs_done = upto
            # Known, computed tokens reach a block's end: one block per decode at most, a
            # chunk may fill several.
            if num_new > 1 or (end if end < num_known else num_known) % block_size == 0:
                filled.append(seq)
            if end == num_known + seq.num_pending:
                logits_row = len(logits_of)
                logits_of.append(i)
                request = seq.request
                if request.beam_search is not None:
                    beams.append((seq, logits_row))
                else:
                    seq.num_pending += 1
                    seq.sample_step = step_id
                    seq.sample_row = len(samplers)
                    samplers.append(seq)
                    sampler_rows.append(logits_row)
                    if not request.branched and request.params.n > 1:
                        forks.append((seq, logits_row))
            seq.num_computed_tokens = end
            i += 1
        counters = self.counters
        counters.tokens_computed += len(token_ids)
        counters.prompt_tokens_computed += prompt_computed
        plan = StepPlan(rows=rows, starts=starts, query_lens=sched.num_new_tokens, token_ids=token_ids,
                        pending_at=pending_at, pending_from=pending_from, logits_of=logits_of,
                        changed_rows=self.block_manager.take_changed_rows(), owners=sched.seqs,
                        extra_logits=extra_logits)
        return plan, samplers, sampler_rows, beams, forks, filled, prompt_logprobs

    def _queue_prompt_logprobs(self, logits: torch.Tensor, wanted: _PromptLogprobs) -> None:
        """The positions' logprobs of their next prompt tokens and the top alternatives, on
        the device, their copy to the host queued (read when the step is collected)."""
        top = max(request.params.prompt_logprobs for request, _ in wanted.segments)
        targets = to_device(wanted.targets, torch.int64, logits.device)
        wanted.copy = HostCopy(list(logprob_tensors(logits, targets, top)))

    def _report_prompt_logprobs(self, wanted: _PromptLogprobs) -> None:
        """Per position: (token id, logprob, rank) of the top `prompt_logprobs` tokens and the
        prompt's own next token (as vLLM's: it is always among them)."""
        chosen, top_values, top_ids, ranks = wanted.copy.lists()
        row = 0
        for request, count in wanted.segments:
            if request.request_id in self.requests and request.error is None:
                k = request.params.prompt_logprobs
                entries = []
                for j in range(row, row + count):
                    entry = [(token, value, rank + 1) for rank, (token, value) in enumerate(zip(top_ids[j][:k], top_values[j][:k]))]
                    if wanted.targets[j] not in top_ids[j][:k]:
                        entry.append((wanted.targets[j], chosen[j], ranks[j]))
                    entries.append(entry)
                self._out.prompt_logprobs.append((request.request_id, entries))
            row += count

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Parallel sampling: when the prompt's last chunk is launched, the other n - 1
        outputs branch off the first, sharing its blocks; all n draw their first token
        from the same logits row."""
        request = parent.request
        request.branched = True
        children = [self._new_sequence(request, index, parent) for index in range(1, request.params.n)]
        request.seqs += children
        self.scheduler.fork(parent, children)
        return children

    def _forward(self, sched: SchedulerOutput, plan: StepPlan) -> torch.Tensor:
        """The step's forward. Should it throw, each request's sequences run again alone:
        a request whose own forward throws fails, and the step goes on without it. When
        every request fails alone too, the fault is not any one request's: it is raised."""
        try:
            return self.runner.forward(plan)
        except TensorParallelError:
            raise  # the ranks are out of step: no request can run alone
        except Exception as exc:
            groups: dict[int, list[int]] = {}
            for i, seq in enumerate(plan.owners):
                groups.setdefault(seq.request.request_id, []).append(i)
            if len(groups) == 1:
                raise
            logger.warning("a step's forward failed (%r); running each of its %d requests alone", exc, len(groups))
            # The retries run one after another, synchronously (the input staging buffers
            # are reused at once).
            self.runner.synchronize()
            wanted = {seq_index: row for row, seq_index in enumerate(plan.logits_of)}
            rows: dict[int, torch.Tensor] = {}  # logits row -> its logits (extra rows after the sequences')
            failed: list[tuple[CoreRequest, Exception]] = []
            for indices in groups.values():
                try:
                    block = self.runner.forward(plan.subset(indices))
                except Exception as own:
                    failed.append((sched.seqs[indices[0]].request, own))
                    continue
                own = [wanted[i] for i in indices if i in wanted]
                rows.update(zip(own, block))
                extra = [len(plan.logits_of) + k for k in plan.extra_rows_of(indices)]
                rows.update(zip(extra, block[len(own):]))
            if len(failed) == len(groups):
                raise
            for request, own in failed:
                self._fail_request(request, f"its forward pass failed: {own!r}", own)
            # Rows of failed requests stay as zeros: nobody samples from them.
            logits = torch.zeros((len(plan.logits_of) + len(plan.extra_logits), self.vocab_size), dtype=torch.float32,
                                 device=self.device)
            for row, values in rows.items():
                logits[row] = values
            return logits

    def _sample(self, logits: torch.Tensor, rows: list[Sequence], index: list[int],
                masks: tuple[torch.Tensor, list[int]] | None = None):
        """Sampling on the device, row i from logits row `index[i]`, under the grammar masks
        (bitmask, the rows it constrains) when there are any. Should the batched
        sampler throw, each request's rows are sampled alone (seeded rows from where their
        generators stood), and a request that throws alone fails."""
        if not rows:
            return _HostSample(SamplerOutput([], [], []), self.device)
        selected = logits if index == list(range(logits.shape[0])) else logits[to_device(index, torch.int64, logits.device)]
        if masks is not None and masks[1]:
            self._bitmask.apply(selected, *masks)
        seeded = [(seq.generator, seq.generator.get_state()) for seq in rows if seq.generator is not None]
        try:
            return self.runner.sample(selected, rows)
        except Exception as exc:
            logger.warning("sampling %d rows failed (%r); sampling each request alone", len(rows), exc)
        for generator, state in seeded:
            generator.set_state(state)
        by_request: dict[int, list[int]] = {}
        for i, seq in enumerate(rows):
            by_request.setdefault(seq.request.request_id, []).append(i)
        merged = SamplerOutput([0] * len(rows), [None] * len(rows), [None] * len(rows))
        for indices in by_request.values():
            try:
                alone = self.runner.sample(selected[indices], [rows[i] for i in indices]).to_host()
            except Exception as own:
                self._fail_request(rows[indices[0]].request, f"sampling failed: {own!r}", own)
                continue
            for j, i in enumerate(indices):
                merged.token_ids[i], merged.logprobs[i], merged.top_logprobs[i] = (
                    alone.token_ids[j], alone.logprobs[j], alone.top_logprobs[j]
                )
        return _HostSample(merged, self.device)

    # --- collecting a step ----------------------------------------------------------------

    def _collect(self, launched: _LaunchedStep) -> None:
        timings = self.runner.step_timings
        sampled = launched.sample.to_host()
        if timings is not None:
            timings.phase("sample")
        out = self._out
        vocab_size = self.vocab_size
        request_ids, seq_indexes, token_ids = out.request_ids, out.seq_indexes, out.token_ids
        reported = len(token_ids)
        generated = 0  # tokens of requests that are not streamed
        now = time.time()
        touched: dict[int, CoreRequest] = {}
        # Requests not streamed whose chunk of tokens so far is due (report_every_s).
        due: dict[int, CoreRequest] = {}
        for row, (seq, token) in enumerate(zip(launched.rows, sampled.token_ids)):
            if seq.status is SequenceStatus.FINISHED:
                continue  # ended (or its request did) since this step was launched
            seq.num_pending -= 1
            request = seq.request
            if token == NO_TOKEN_ALLOWED:
                self._fail_request(request, "no token is allowed: its structured output, allowed_token_ids, "
                                   "bad_words and min_tokens together rule out every token", invalid_input=True)
                continue
            if not 0 <= token < vocab_size:
                self._fail_request(request, f"sampling produced token id {token}, outside the vocabulary")
                continue
            known = seq.token_ids
            known.append(token)
            grammar = seq.grammar
            if grammar is not None and not grammar.accept_token(token):
                self._fail_request(request, f"sampled token {token}, which its structured output's grammar does not allow "
                                   "(min_tokens can hold back the only token a finished grammar allows, its eos)")
                continue
            if request.stream:
                request_ids.append(request.request_id)
                seq_indexes.append(seq.index)
                token_ids.append(token)
                if request.wants_logprobs:
                    top = sampled.top_logprobs[row]
                    out.logprobs.append(
                        (len(token_ids) - 1, sampled.logprobs[row], [(t, e.logprob, e.rank) for t, e in top.items()])
                    )
            else:
                if request.first_token_time is None:
                    request.first_token_time = now
                if now >= request.report_at:
                    due[request.request_id] = request
                generated += 1
            if len(known) >= seq.max_num_tokens:
                self._finish(seq, "length", None)
                touched[request.request_id] = request
            elif token in request.stop_reasons:
                self._finish(seq, "stop", request.stop_reasons[token])
                touched[request.request_id] = request
            elif grammar is not None and grammar.is_terminated():
                # The output is complete (its stop token accepted with ignore_eos, say): nothing more may follow.
                self._finish(seq, "stop", None)
                touched[request.request_id] = request
        self.counters.generation_tokens += len(token_ids) - reported + generated
        out.unreported_tokens += generated
        if launched.prompt_logprobs is not None:
            self._report_prompt_logprobs(launched.prompt_logprobs)
        if launched.beams:
            values, ids = launched.beam_top.lists()
            for seq, top_values, top_ids in zip(launched.beams, values, ids):
                self._report_beam(seq, top_values, top_ids)
        for request in due.values():
            request.report_at = now + request.report_every_s
            for seq in request.seqs:
                # (An ended one sent its last chunk as it ended.)
                if not seq.is_finished and seq.num_unreported_tokens:
                    self._report_chunk(seq)
        for request in touched.values():
            self._retire_if_done(request)
        if timings is not None:
            timings.phase("update")

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | None) -> None:
        self.scheduler.finish(seq)
        request = seq.request
        self._out.finished.append((request.request_id, seq.index, reason, stop_reason))
        if not request.stream:
            self._report_chunk(seq)

    def _report_chunk(self, seq: Sequence) -> None:
        """A sequence of a request that is not streamed: its output tokens since its last chunk."""
        request = seq.request
        first = request.first_token_time if request.first_token_time is not None else time.time()
        start = seq.num_prompt_tokens + seq.num_reported
        chunk = seq.token_ids[start:]
        seq.num_reported += len(chunk)
        self._out.token_chunks.append((request.request_id, seq.index, chunk, first))

    def _end_sequences(self, request: CoreRequest) -> None:
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)

    def _fail_request(self, request: CoreRequest, error: str, exc: BaseException | None = None,
                      invalid_input: bool = False) -> None:
        """Something this request caused threw: it ends now (its blocks freed) and the
        front hears why (`invalid_input`: its input alone is to blame, whatever engine runs
        it); the other requests carry on."""
        if request.error is not None or request.request_id not in self.requests:
            return
        logger.warning("request %s failed alone: %s", request.request_id, error, exc_info=exc)
        request.error = error
        if not request.stream:
            for seq in request.seqs:
                if not seq.is_finished and seq.num_unreported_tokens:
                    self._report_chunk(seq)  # what it made before it failed
        self._end_sequences(request)
        del self.requests[request.request_id]
        self.counters.requests_failed += 1
        self._out.failed.append((request.request_id, error, invalid_input))

    # --- beam search (its requests are synchronous: each round is seen on the host) -------

    def _report_beam(self, seq: Sequence, top_values: list[float], top_ids: list[int]) -> None:
        """A live beam hands in its most likely next tokens; a request whose every live
        beam has reported moves to its next beams."""
        request = seq.request
        if seq.is_finished or request.error is not None:
            return
        search = request.beam_search
        k = search.num_candidates
        try:
            if search.report(seq, seq.output_token_ids, seq.cumulative_logprob, list(zip(top_ids[:k], top_values[:k]))):
                self._next_beams(request)
        except Exception as exc:
            self._fail_request(request, f"advancing its beams failed: {exc!r}", exc)

    def _next_beams(self, request: CoreRequest) -> None:
        """Branch the chosen beams off their parents and drop the old ones; when the search
        is over, its best hypotheses go to the front and the request ends."""
        search = request.beam_search
        proposals = search.advance(self.max_model_len)
        children = []
        for index, proposal in enumerate(proposals):
            child = self._new_sequence(request, index, proposal.parent)
            self.scheduler.fork(proposal.parent, [child])
            child.token_ids.append(proposal.token_id)
            child.cumulative_logprob = proposal.cum_logprob
            children.append(child)
        for old in search.live:
            # Usually parked in the running queue, but preemption may have moved it since it reported.
            self.scheduler.finish(old)
        self.counters.generation_tokens += len(children)
        request.branched = True
        request.seqs = search.live = children
        if children:
            return
        best = [
            BeamHypothesis(h.output_token_ids, h.cum_logprob, "stop" if h.ends_with_eos else "length")
            for h in search.best()
        ]
        self._out.beams.append((request.request_id, best))
        del self.requests[request.request_id]
        self.counters.requests_finished += 1

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
