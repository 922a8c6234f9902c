"""Publishes what running jobs have produced so far: text deltas to each job's Redis stream
(GET /stream relays them) and the partial result to `job.meta` (GET /result shows it).
After a job's first token, its deltas go out at most every `stream_interval_s` (0: every
engine step), batching tokens into fewer events when relaying them is what costs.

`update()` only records an engine output; `publish()` queues everything recorded since
the last send into a caller's pipeline as one script call, whatever the number of jobs
(the batch worker sends it with its own per-step call: one round trip per engine step),
and `published()` marks it sent. A pipeline that fails (Redis away) changes nothing
here, so the next one carries the text the failed one missed: a stream never skips text.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from redis import Redis
from redis.client import Pipeline
from rq.job import Job

from pagedq.outputs import RequestOutput
from pagedq.protocol import EVENT_DELTA, EVENT_END, EVENT_RESET, PROGRESS_META_KEY, JobState, Progress, stream_key

# One round trip for a whole engine step, whatever the number of jobs: on a small model
# the worker's Redis traffic would otherwise cost as much as the step itself.
# KEYS: the stream of each delta (a job with n > 1 outputs has a delta per output), then
# the job hashes getting a partial result. ARGV: the stream TTL, the number of deltas,
# (index, text, num_tokens, new, logprobs) per delta, then the serialized job.meta per job
# hash. `logprobs` is "" unless the job asked for them: then the JSON list of the delta's
# new tokens, each [token id, {token id: logprob}]. A stream's TTL is set by its first
# delta (new = 1) and kept by XADD. A meta is written only if its job still exists: a
# write to a deleted job would recreate its hash.
_PUBLISH = """
local ttl, deltas = ARGV[1], tonumber(ARGV[2])
for i = 1, deltas do
    local at = 5 * i - 2
    if ARGV[at + 4] == '' then
        redis.call('XADD', KEYS[i], '*', 'type', 'delta', 'index', ARGV[at], 'text', ARGV[at + 1], 'num_tokens', ARGV[at + 2])
    else
        redis.call('XADD', KEYS[i], '*', 'type', 'delta', 'index', ARGV[at], 'text', ARGV[at + 1], 'num_tokens', ARGV[at + 2],
                   'logprobs', ARGV[at + 4])
    end
    if ARGV[at + 3] == '1' then
        redis.call('EXPIRE', KEYS[i], ttl)
    end
end
for i = deltas + 1, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 1 then
        redis.call('HSET', KEYS[i], 'meta', ARGV[4 * deltas + i + 2])
    end
end
return #KEYS
"""
assert EVENT_DELTA == "delta"  # spelled out in the script above


def _meta_with(job: Job, progress: Progress) -> bytes:
    """The job's serialized meta (what job.save_meta() writes) with this progress in it."""
    job.meta[PROGRESS_META_KEY] = progress.model_dump(mode="json")
    return job.serializer.dumps(job.meta)


def write_progress(pipeline: Pipeline, job: Job, progress: Progress) -> None:
    pipeline.hset(job.key, "meta", _meta_with(job, progress))


def read_progress(job: Job) -> Progress:
    return Progress.model_validate(job.meta.get(PROGRESS_META_KEY) or {})


def append_event(pipeline: Pipeline, seq_id: str, stream_ttl_s: int, fields: dict[str, str]) -> None:
    key = stream_key(seq_id)
    pipeline.xadd(key, fields)
    pipeline.expire(key, stream_ttl_s)


def publish_end(pipeline: Pipeline, seq_id: str, status: JobState, stream_ttl_s: int, finish_reason: str = "") -> None:
    append_event(pipeline, seq_id, stream_ttl_s, {"type": EVENT_END, "status": status, "finish_reason": finish_reason})


@dataclass
class _Published:
    job: Job
    progress: Progress
    stream: bool
    output: RequestOutput | None = None
    # How much of each output (by index) the stream has.
    sent_chars: list[int] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    next_progress_at: float = 0.0
    next_delta_at: float = 0.0


def _logprobs_json(completion, sent_tokens: int) -> str:
    """The new tokens' logprobs for a delta: [[token id, {token id: logprob}], ...], or "" when not asked for."""
    if completion.logprobs is None:
        return ""
    new = zip(completion.token_ids[sent_tokens:], completion.logprobs[sent_tokens:])
    return json.dumps([[token, {str(t): lp.logprob for t, lp in step.items()}] for token, step in new], separators=(",", ":"))


def _pad(counts: list[int], length: int) -> list[int]:
    """`counts` with a 0 for each output that has none yet (n > 1 outputs appear when the prompt is done)."""
    return counts + [0] * (length - len(counts))


class ProgressPublisher:
    def __init__(self, connection: Redis, stream_ttl_s: int, progress_interval_s: float, stream_interval_s: float = 0.0):
        self.connection = connection
        self.stream_ttl_s = stream_ttl_s
        self.progress_interval_s = progress_interval_s
        self.stream_interval_s = stream_interval_s
        self._jobs: dict[str, _Published] = {}
        self._dirty: set[str] = set()
        # Jobs whose recorded output the pending publish() carries in full.
        self._sending: set[str] = set()

    def start(self, pipeline: Pipeline, job: Job, prompt_tokens: int, stream: bool = True) -> None:
        """Called when a job (re)starts running; records the attempt number. `stream`
        false: only partial results, no deltas (JobPayload.stream)."""
        attempt = read_progress(job).attempt + 1
        progress = Progress(prompt_tokens=prompt_tokens, attempt=attempt)
        self._jobs[job.id] = _Published(job, progress, stream)
        self._dirty.discard(job.id)
        write_progress(pipeline, job, progress)
        if attempt > 1:
            # A previous attempt died part-way: its deltas are in the stream already.
            append_event(pipeline, job.id, self.stream_ttl_s, {"type": EVENT_RESET, "attempt": str(attempt)})

    def update(self, seq_id: str, output: RequestOutput) -> None:
        """Record the job's latest (cumulative) output; nothing is sent until flush()."""
        state = self._jobs[seq_id]
        state.output = output
        progress = state.progress
        if progress.first_token is None and output.outputs[0].token_ids:
            progress.first_token = output.metrics.first_token_time or time.time()
        self._dirty.add(seq_id)

    def publish(self, pipeline: Pipeline) -> None:
        """Queue everything recorded since the last published() into `pipeline`, as one
        script call; call published() once the pipeline has run."""
        self._sending.clear()
        if not self._dirty:
            return
        now = time.monotonic()
        streams: list[str] = []
        deltas: list[str | int] = []
        progress_due: list[_Published] = []
        for seq_id in self._dirty:
            state = self._jobs[seq_id]
            started = any(state.sent_tokens)
            # The first token and the last go at once; in between a job's deltas are batched
            # to one per stream_interval_s (what is held back stays dirty for a later step).
            if state.stream and started and not state.output.finished and now < state.next_delta_at:
                continue
            self._sending.add(seq_id)
            if state.stream:
                outputs = state.output.outputs
                sent_tokens, sent_chars = _pad(state.sent_tokens, len(outputs)), _pad(state.sent_chars, len(outputs))
                for index, completion in enumerate(outputs):
                    if len(completion.token_ids) > sent_tokens[index]:
                        state.next_delta_at = now + self.stream_interval_s
                        streams.append(stream_key(seq_id))
                        deltas += [index, completion.text[sent_chars[index]:], len(completion.token_ids), int(not started),
                                   _logprobs_json(completion, sent_tokens[index])]
                        started = True
            # Partial results are rewritten whole, so they are throttled; deltas never are.
            if now >= state.next_progress_at and not state.output.finished:
                state.next_progress_at = now + self.progress_interval_s
                progress_due.append(state)
        metas = []
        for state in progress_due:
            completion = state.output.outputs[0]
            state.progress.text = completion.text
            state.progress.token_ids = list(completion.token_ids)
            metas.append(_meta_with(state.job, state.progress))
        keys = [*streams, *(state.job.key for state in progress_due)]
        # EVAL, not EVALSHA: a pipeline cannot reload a script a restarted Redis forgot.
        pipeline.eval(_PUBLISH, len(keys), *keys, self.stream_ttl_s, len(streams), *deltas, *metas)

    def published(self) -> None:
        """The pipeline given to publish() ran: what it carried is sent."""
        for seq_id in self._sending:
            state = self._jobs.get(seq_id)
            if state is not None:
                state.sent_chars = [len(completion.text) for completion in state.output.outputs]
                state.sent_tokens = [len(completion.token_ids) for completion in state.output.outputs]
        self._dirty -= self._sending
        self._sending.clear()

    def flush(self) -> None:
        """Send everything recorded so far, in one round trip."""
        with self.connection.pipeline(transaction=False) as pipeline:
            self.publish(pipeline)
            pipeline.execute()
        self.published()

    def forget(self, seq_id: str) -> None:
        self._jobs.pop(seq_id, None)
        self._dirty.discard(seq_id)
        self._sending.discard(seq_id)
