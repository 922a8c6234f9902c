"""The start of jobs a worker took from its queues: RQ's bookkeeping, on the I/O thread
(the engine thread then hands them to the engine)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import redis.exceptions
from redis import Redis
from redis.client import Pipeline
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue

from pagedq.protocol import JobPayload
from pagedq.redis_schema import JOB_FUNCTION, InvalidJob, record_execution
from worker.rq.inflight import Started
from worker.rq.publisher import start_progress


def start_jobs(connection: Redis, ids: list[str], queues: list[Queue], serializer, worker_name: str,
               heartbeat_ttl_s: int, stream_ttl_s: int, mark_busy: Callable[[Pipeline], None]) -> list[Started]:
    """Mark the taken jobs started in one transaction, with each one's first progress (its
    attempt number; a "reset" event on a rerun); `mark_busy` adds the worker's own state to
    it. A job deleted or canceled while in transit is left out; one whose payload cannot
    be read comes back with its error (it fails, never retried)."""
    queues_by_name = {queue.name: queue for queue in queues}
    with connection.pipeline() as pipeline:
        while True:
            try:
                # A cancel landing between our read and write must win, not be overwritten.
                pipeline.watch(*(Job.key_for(i) for i in ids))
                jobs = Job.fetch_many(ids, connection, serializer=serializer)
                pipeline.multi()
                started: list[Started] = []
                for job_id, job in zip(ids, jobs):
                    # Out of the intermediate queue it was moved to (its origin's, or any when it is gone).
                    for queue in [queues_by_name.get(job.origin, queues[0])] if job is not None else queues:
                        pipeline.lrem(queue.intermediate_queue_key, 1, job_id)
                    if job is None or job.get_status(refresh=False) != JobStatus.QUEUED:
                        continue  # deleted or canceled while in transit
                    execution = Execution.create(job, heartbeat_ttl_s, pipeline, worker_name=worker_name)
                    job.prepare_for_execution(worker_name, pipeline)
                    record_execution(pipeline, job, execution.composite_key)
                    item = Started(job, execution)
                    try:
                        if job.func_name != JOB_FUNCTION:
                            raise InvalidJob(f"this worker runs only {JOB_FUNCTION} jobs, not {job.func_name}")
                        item.payload = JobPayload.read(job.kwargs)
                        start_progress(pipeline, job, len(item.payload.prompt_token_ids), stream_ttl_s)
                    except Exception:
                        item.error = sys.exc_info()
                    started.append(item)
                mark_busy(pipeline)
                pipeline.execute()
                return started
            except redis.exceptions.WatchError:
                continue
