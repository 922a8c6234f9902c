"""Publishes what running jobs have produced so far, as deltas (text and token ids) to each
job's Redis stream: GET /stream relays them, and GET /result reads the partial result back
from them (redis_schema.read_partial), so each token is written once and nothing grows by
being rewritten. After a job's first token, its deltas go out at most every
`stream_interval_s` (0: every engine step), batching tokens into fewer events when relaying
them is what costs; a job nobody streams (JobPayload.stream false) every `progress_interval_s`.

`update()` only records an engine output; `publish()` queues everything recorded since
the last send into a caller's pipeline as one script call (redis_schema.PUBLISH_STEP_SCRIPT,
fenced: nothing is written for a job its execution no longer owns), whatever the number of
jobs (the batch worker sends it with its own per-step call: one round trip per engine
step), and `published()` marks it sent. A pipeline that fails (Redis away) is handed to
`failed()`, so the next one carries the text the failed one missed: a stream never skips text.
A round trip that broke off (the connection lost, its reply unread) may or may not have run:
it goes to `uncertain()`, and the next send splits its text where that one ended and lets
the script skip what the stream holds already (redis_schema.PUBLISH_STEP_SCRIPT): a stream
never repeats text either.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from redis import Redis
from redis.client import Pipeline
from rq.job import Job

from pagedq.outputs import RequestOutput
from pagedq.protocol import logprob_dicts
from pagedq.redis_schema import (
    PUBLISH_STEP_SCRIPT,
    UNFENCED,
    WRITTEN_KEY,
    Progress,
    delta_logprobs,
    publish_reset,
    read_progress,
    stream_key,
    write_progress,
)


class Delta(NamedTuple):
    """One delta event for PUBLISH_STEP_SCRIPT (its DELTA_ARGS, in this order)."""

    index: int
    text: str
    # Output `index`'s tokens so far, this delta's included.
    num_tokens: int
    # The stream's first delta: it sets the stream's TTL.
    new: bool
    # The JSON of the delta's tokens' logprobs, "" when not asked for.
    logprobs: str
    # The stream may hold it already (an earlier send's reply was lost): written only if not.
    check: bool
    # The delta's token ids, comma-separated.
    ids: str
    # With `new`: when the attempt's first token came (Unix seconds).
    first_token: float

    def args(self) -> tuple[int, str, int, int, str, int, str, float]:
        return (self.index, self.text, self.num_tokens, int(self.new), self.logprobs, int(self.check), self.ids,
                self.first_token)



@dataclass
class _Published:
    job: Job
    # Deltas every stream_interval_s (else every progress_interval_s: nobody streams them).
    stream: bool
    # The composite key of the job's execution, whose ownership the script checks before
    # writing (UNFENCED: none).
    fence: str
    output: RequestOutput | None = None
    first_token: float | None = None
    # How much of each output (by index) the stream has.
    sent_chars: list[int] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    # (chars, tokens) per output that each send since, whose reply was lost, would have left
    # the stream with (oldest first): the stream holds one of these or sent_* itself.
    unsure: list[tuple[list[int], list[int]]] = field(default_factory=list)
    next_delta_at: float = 0.0

    def delta_due(self, now: float) -> bool:
        """Its first delta goes at once; after that, one per interval."""
        return not any(self.sent_tokens) or now >= self.next_delta_at


def _logprobs_json(completion, start: int, stop: int) -> str:
    """Tokens [start, stop)'s logprobs for a delta: [[token id, {token id: logprob}], ...], or "" when not asked for."""
    if completion.logprobs is None:
        return ""
    steps = logprob_dicts(completion.logprobs[start:stop])
    return json.dumps(delta_logprobs(completion.token_ids[start:stop], steps), separators=(",", ":"))


def start_progress(pipeline: Pipeline, job: Job, prompt_tokens: int, stream_ttl_s: int) -> None:
    """Queue a job's progress as it (re)starts running: its attempt number (and a "reset"
    event on its stream when an earlier attempt died part-way: that attempt's deltas are in
    the stream already)."""
    attempt = read_progress(job).attempt + 1
    write_progress(pipeline, job, Progress(prompt_tokens=prompt_tokens, attempt=attempt))
    if attempt > 1:
        publish_reset(pipeline, job.id, attempt, stream_ttl_s)


@dataclass
class Sending:
    """What one publish() queued: the jobs in the script's order, and how much of each
    output (characters, tokens) the streams will have once it has run."""

    jobs: list[str] = field(default_factory=list)
    counts: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    queued: bool = False


def _count(counts: list[int], index: int) -> int:
    """Output `index`'s entry in `counts`, 0 when it has none yet (n > 1 outputs appear when the prompt is done)."""
    return counts[index] if index < len(counts) else 0


def _pieces(state: _Published, index: int) -> list[tuple[int, int, int, int]]:
    """(first char, end char, first token, end token) of each delta output `index` needs: one
    from what the stream surely has to now, split where each uncertain send ended."""
    completion = state.output.outputs[index]
    ends = [(_count(chars, index), _count(tokens, index)) for chars, tokens in state.unsure]
    ends.append((len(completion.text), len(completion.token_ids)))
    pieces = []
    start_char, start_token = _count(state.sent_chars, index), _count(state.sent_tokens, index)
    for end_char, end_token in ends:
        if end_token > start_token:
            pieces.append((start_char, end_char, start_token, end_token))
            start_char, start_token = end_char, end_token
    return pieces


class ProgressPublisher:
    def __init__(self, connection: Redis, stream_ttl_s: int, progress_interval_s: float, stream_interval_s: float = 0.0):
        self.connection = connection
        self.stream_ttl_s = stream_ttl_s
        self.progress_interval_s = progress_interval_s
        self.stream_interval_s = stream_interval_s
        self._jobs: dict[str, _Published] = {}
        self._dirty: set[str] = set()

    def report_every_s(self, stream: bool) -> float | None:
        """How often the engine need tell a job's progress (LLMEngine.add_request's
        report_every_s): every step for a streamed job (None); for one nobody streams,
        only as often as its deltas go, so its tokens come from the engine core in chunks
        instead of one per step."""
        return None if stream or self.progress_interval_s == 0 else self.progress_interval_s

    def start(self, pipeline: Pipeline, job: Job, prompt_tokens: int, stream: bool = True) -> None:
        """Called when a job (re)starts running: start_progress(), then track()."""
        start_progress(pipeline, job, prompt_tokens, self.stream_ttl_s)
        self.track(job, stream)

    def track(self, job: Job, stream: bool = True, fence: str = UNFENCED) -> None:
        """Follow a job start_progress() has started. `stream` false: nobody follows its
        deltas as they come, so they go at progress_interval_s (JobPayload.stream). `fence`:
        its execution's composite key, each write for it then made only while that
        execution owns the job (redis_schema.owns())."""
        self._jobs[job.id] = _Published(job, stream, fence)
        self._dirty.discard(job.id)

    def update(self, seq_id: str, output: RequestOutput) -> None:
        """Record the job's latest (cumulative) output; nothing is sent until flush()."""
        state = self._jobs[seq_id]
        state.output = output
        if state.first_token is None and any(completion.token_ids for completion in output.outputs):
            state.first_token = output.metrics.first_token_time or time.time()
        self._dirty.add(seq_id)

    def due(self, seq_id: str) -> bool:
        """Whether publish() would send the job's next delta now (its first goes at once,
        the others one per interval): until then its output need not even be built."""
        state = self._jobs.get(seq_id)
        return state is None or state.delta_due(time.monotonic())

    def publish(self, pipeline: Pipeline) -> Sending:
        """Queue everything recorded since the last send into `pipeline` as one script
        call, each job's writes fenced as track() was told; once the pipeline has run, pass
        its reply to published() (or the Sending to failed() if Redis refused the script,
        uncertain() if the reply was lost). Only one Sending may be in flight: the next
        publish() follows one of those."""
        sending = Sending()
        if not self._dirty:
            return sending
        now = time.monotonic()
        keys: list[str] = []
        args: list[str | int | bytes] = [self.stream_ttl_s]
        for seq_id in list(self._dirty):
            state = self._jobs[seq_id]
            # The first token and the last go at once; in between a job's deltas are batched
            # to one per interval (what is held back stays dirty for a later step).
            if not state.output.finished and not state.delta_due(now):
                continue
            started = any(state.sent_tokens)
            self._dirty.discard(seq_id)
            outputs = state.output.outputs
            deltas: list[Delta] = []
            # After an uncertain send the script looks at what the stream has before each write.
            check = bool(state.unsure)
            for index, completion in enumerate(outputs):
                for start_char, end_char, start_token, end_token in _pieces(state, index):
                    ids = ",".join(map(str, completion.token_ids[start_token:end_token]))
                    deltas.append(Delta(index, completion.text[start_char:end_char], end_token, not started,
                                        _logprobs_json(completion, start_token, end_token), check, ids,
                                        state.first_token or 0.0))
                    started = True
            if not deltas:
                continue
            state.next_delta_at = now + (self.stream_interval_s if state.stream else self.progress_interval_s)
            keys += [state.job.key, stream_key(seq_id)]
            args += [state.fence, len(deltas), *(arg for delta in deltas for arg in delta.args())]
            sending.jobs.append(seq_id)
            sending.counts[seq_id] = ([len(c.text) for c in outputs], [len(c.token_ids) for c in outputs])
        if sending.jobs:
            # EVAL, not EVALSHA: a pipeline cannot reload a script a restarted Redis forgot.
            keys.append(WRITTEN_KEY)
            pipeline.eval(PUBLISH_STEP_SCRIPT, len(keys), *keys, *args)
            sending.queued = True
        return sending

    def published(self, sending: Sending, reply: list[int] | None) -> list[str]:
        """The pipeline given to publish() ran and the script answered `reply`: what it
        carried is sent. Returns the jobs it refused to write for (no longer ours)."""
        for seq_id, (chars, tokens) in sending.counts.items():
            state = self._jobs.get(seq_id)
            if state is not None:
                state.sent_chars, state.sent_tokens, state.unsure = chars, tokens, []
        return [sending.jobs[position - 1] for position in reply or []]

    def failed(self, sending: Sending) -> None:
        """Redis refused the script (it wrote nothing): the next publish() sends the same text again."""
        self._dirty.update(seq_id for seq_id in sending.jobs if seq_id in self._jobs)

    def uncertain(self, sending: Sending) -> None:
        """The round trip broke off: the script may have run. The next publish() sends the
        text again, split where this one ended, for the script to skip what the stream has."""
        for seq_id in sending.jobs:
            state = self._jobs.get(seq_id)
            if state is not None:
                state.unsure.append(sending.counts[seq_id])
                self._dirty.add(seq_id)

    def flush(self) -> None:
        """Send everything recorded so far, in one round trip."""
        with self.connection.pipeline(transaction=False) as pipeline:
            sending = self.publish(pipeline)
            try:
                replies = pipeline.execute()
            except BaseException:
                self.uncertain(sending)
                raise
        self.published(sending, replies[-1] if sending.queued else None)

    def forget(self, seq_id: str) -> None:
        self._jobs.pop(seq_id, None)
        self._dirty.discard(seq_id)
