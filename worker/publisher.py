"""Publishes what a running job has produced so far: text deltas to the job's Redis stream
(GET /stream relays them) and the partial result to `job.meta` (GET /result shows it).

Every write goes into a caller's pipeline, so a worker sends one round trip per engine
step for all its jobs.
"""

from __future__ import annotations

import time

from redis.client import Pipeline
from rq.job import Job

from pagedq.outputs import RequestOutput
from pagedq.protocol import EVENT_DELTA, EVENT_END, EVENT_RESET, PROGRESS_META_KEY, JobState, Progress, stream_key


def write_progress(pipeline: Pipeline, job: Job, progress: Progress) -> None:
    job.meta[PROGRESS_META_KEY] = progress.model_dump(mode="json")
    # What job.save_meta() writes, but into the pipeline.
    pipeline.hset(job.key, "meta", job.serializer.dumps(job.meta))


def read_progress(job: Job) -> Progress:
    return Progress.model_validate(job.meta.get(PROGRESS_META_KEY) or {})


def publish_end(pipeline: Pipeline, seq_id: str, status: JobState, stream_ttl_s: int, **fields: str) -> None:
    key = stream_key(seq_id)
    pipeline.xadd(key, {"type": EVENT_END, "status": status, **fields})
    pipeline.expire(key, stream_ttl_s)


class ProgressPublisher:
    def __init__(self, stream_ttl_s: int, progress_interval_s: float):
        self.stream_ttl_s = stream_ttl_s
        self.progress_interval_s = progress_interval_s
        self._sent_chars: dict[str, int] = {}
        self._next_progress_at: dict[str, float] = {}
        self._progress: dict[str, Progress] = {}

    def start(self, pipeline: Pipeline, job: Job, prompt_tokens: int) -> None:
        """Called when a job (re)starts running; records the attempt number."""
        attempt = read_progress(job).attempt + 1
        progress = Progress(prompt_tokens=prompt_tokens, attempt=attempt)
        self._progress[job.id] = progress
        self._sent_chars[job.id] = 0
        self._next_progress_at[job.id] = 0.0
        write_progress(pipeline, job, progress)
        if attempt > 1:
            # A previous attempt died part-way: its deltas are in the stream already.
            self._xadd(pipeline, job.id, {"type": EVENT_RESET, "attempt": str(attempt)})

    def update(self, pipeline: Pipeline, job: Job, output: RequestOutput) -> None:
        completion = output.outputs[0]
        sent = self._sent_chars[job.id]
        if len(completion.text) > sent:
            self._xadd(pipeline, job.id, {"type": EVENT_DELTA, "text": completion.text[sent:]})
            self._sent_chars[job.id] = len(completion.text)

        progress = self._progress[job.id]
        progress.text = completion.text
        progress.token_ids = list(completion.token_ids)
        if progress.first_token is None and completion.token_ids:
            progress.first_token = output.metrics.first_token_time or time.time()
        now = time.monotonic()
        # Partial results are rewritten whole, so throttle them; deltas are never throttled.
        if now >= self._next_progress_at[job.id] and not output.finished:
            write_progress(pipeline, job, progress)
            self._next_progress_at[job.id] = now + self.progress_interval_s

    def forget(self, seq_id: str) -> None:
        self._sent_chars.pop(seq_id, None)
        self._next_progress_at.pop(seq_id, None)
        self._progress.pop(seq_id, None)

    def _xadd(self, pipeline: Pipeline, seq_id: str, fields: dict[str, str]) -> None:
        key = stream_key(seq_id)
        pipeline.xadd(key, fields)
        pipeline.expire(key, self.stream_ttl_s)
