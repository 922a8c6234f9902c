"""Publishes what running jobs have produced so far: text deltas to each job's Redis stream
(GET /stream relays them) and the partial result to `job.meta` (GET /result shows it).
After a job's first token, its deltas go out at most every `stream_interval_s` (0: every
engine step), batching tokens into fewer events when relaying them is what costs.

`update()` only records an engine output; `publish()` queues everything recorded since
the last send into a caller's pipeline as one script call (redis_schema.PUBLISH_STEP_SCRIPT), whatever the number of jobs
(the batch worker sends it with its own per-step call: one round trip per engine step),
and `published()` marks it sent. A pipeline that fails (Redis away) changes nothing
here, so the next one carries the text the failed one missed: a stream never skips text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from redis import Redis
from redis.client import Pipeline
from rq.job import Job

from pagedq.outputs import RequestOutput
from pagedq.redis_schema import PUBLISH_STEP_SCRIPT, Progress, meta_with, publish_reset, read_progress, stream_key, write_progress


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
            publish_reset(pipeline, job.id, attempt, self.stream_ttl_s)

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
                        deltas += [index, completion.text[sent_chars[index]:], len(completion.token_ids), int(not started)]
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
            metas.append(meta_with(state.job, state.progress))
        keys = [*streams, *(state.job.key for state in progress_due)]
        # EVAL, not EVALSHA: a pipeline cannot reload a script a restarted Redis forgot.
        pipeline.eval(PUBLISH_STEP_SCRIPT, len(keys), *keys, self.stream_ttl_s, len(streams), *deltas, *metas)

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
