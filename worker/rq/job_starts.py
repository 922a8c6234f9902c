"""The start of jobs a worker took from its queues: RQ's bookkeeping, on the I/O thread
(the engine thread then hands them to the engine)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from redis import Redis
from redis.client import Pipeline
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import as_text

from pagedq.protocol import JobPayload
from pagedq.redis_schema import JOB_FUNCTION, InvalidJob, JobStart, queue_job_starts, record_execution
from worker.rq.inflight import Started
from worker.rq.publisher import start_progress


def start_jobs(connection: Redis, ids: list[str], queues: list[Queue], serializer, worker_name: str,
               heartbeat_ttl_s: int, stream_ttl_s: int, mark_busy: Callable[[Pipeline], None]) -> list[Started]:
    """Mark the taken jobs started, each with its first progress (its attempt number; a
    "reset" event on a rerun), in one script call that starts each only if it is still
    the queued job read here (redis_schema.START_JOBS_SCRIPT); `mark_busy` adds the
    worker's own state. A job deleted or canceled while in transit is left out; one whose
    payload cannot be read comes back with its error (it fails, never retried)."""
    queues_by_name = {queue.name: queue for queue in queues}
    # Read as Job.fetch_many reads, without its transaction: the script checks what it needs.
    with connection.pipeline(transaction=False) as pipeline:
        for job_id in ids:
            pipeline.hgetall(Job.key_for(job_id))
        hashes = pipeline.execute()
    starts: list[JobStart] = []
    candidates: list[Started | None] = []
    for job_id, raw in zip(ids, hashes):
        job = None
        if raw:
            job = Job(job_id, connection=connection, serializer=serializer)
            job.restore(raw)
        removal = connection.pipeline(transaction=False)
        # Out of the intermediate queue it was moved to (its origin's, or any when it is gone).
        for queue in [queues_by_name.get(job.origin, queues[0])] if job is not None else queues:
            removal.lrem(queue.intermediate_queue_key, 1, job_id)
        start = connection.pipeline(transaction=False)
        if job is None or job.get_status(refresh=False) != JobStatus.QUEUED:
            starts.append(JobStart(Job.key_for(job_id), None, removal, start))
            candidates.append(None)  # deleted or canceled while in transit
            continue
        execution = Execution.create(job, heartbeat_ttl_s, start, worker_name=worker_name)
        job.prepare_for_execution(worker_name, start)
        record_execution(start, job, execution.composite_key)
        item = Started(job, execution)
        try:
            if job.func_name != JOB_FUNCTION:
                raise InvalidJob(f"this worker runs only {JOB_FUNCTION} jobs, not {job.func_name}")
            item.payload = JobPayload.read(job.kwargs)
            start_progress(start, job, len(item.payload.prompt_token_ids), stream_ttl_s)
        except Exception:
            item.error = sys.exc_info()
        starts.append(JobStart(job.key, as_text(raw.get(b"created_at", b"")), removal, start))
        candidates.append(item)
    with connection.pipeline(transaction=False) as pipeline:
        queue_job_starts(pipeline, starts)
        mark_busy(pipeline)
        skipped = set(pipeline.execute()[0])
    return [item for position, item in enumerate(candidates, 1) if item is not None and position not in skipped]
