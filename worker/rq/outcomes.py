"""What RQ records when a job ends on the batch worker: finished, failed (or retried), or
requeued by a drain. Each is written by RQ's own methods, as RQ's worker would write it, on
a recorder (a pipeline that never runs), so the worker sends many at once as one fenced
script call (redis_schema.queue_fenced_commands): each applied only if the job's execution
still owns the job, so a job reaped and rerun elsewhere meanwhile is left to its new run.
Our jobs have no dependents, repeats, callbacks, webhooks or rate limits: the parts of RQ's
paths left out.
"""

from __future__ import annotations

from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import now as utcnow
from rq.worker import BaseWorker

from pagedq.redis_schema import FencedWrite, publish_end, stream_key
from worker.rq.inflight import InFlight


def success(worker: BaseWorker, entry: InFlight, heartbeat_ttl_s: int, stream_ttl_s: int) -> FencedWrite:
    """RQ's success writes for a finished job (status, result, registries, the worker's
    counters), then its stream's "end" (after the result, so a client that sees "end" can
    read it). A job nobody streamed loses its deltas first: they were its partial result,
    and the result holds them all."""
    job, execution = entry.job, entry.execution
    recorder = worker.connection.pipeline(transaction=False)
    job.ended_at = utcnow()
    job.heartbeat(job.ended_at, heartbeat_ttl_s, pipeline=recorder)
    job._result = entry.result.model_dump(mode="json")
    job._status = JobStatus.FINISHED
    worker.increment_successful_job_count(recorder)
    worker.increment_total_working_time(job.ended_at - job.started_at, recorder)
    result_ttl = job.get_result_ttl(worker.default_result_ttl)
    if result_ttl != 0:
        job._handle_success(result_ttl, pipeline=recorder, worker_name=worker.name, execution_id=execution.id,
                            execution_started_at=execution.created_at, execution_ended_at=job.ended_at)
    job.cleanup(result_ttl, pipeline=recorder, remove_from_queue=False)
    execution.delete(job=job, pipeline=recorder)
    if not entry.payload.stream:
        recorder.delete(stream_key(job.id))
    result = entry.result
    publish_end(recorder, job.id, "finished", stream_ttl_s, finish_reason=result.finish_reason or "",
                outputs=result.output_ends(),
                completion_tokens=result.usage.completion_tokens)
    return FencedWrite(job.key, execution.composite_key, recorder)


def failure(worker: BaseWorker, job: Job, queue: Queue, execution: Execution, exc_string: str, *, stopped: bool,
            retry: bool, end_stream: bool, heartbeat_ttl_s: int, stream_ttl_s: int) -> FencedWrite:
    """RQ's failure writes: the status (STOPPED for RQ's stop-job command, else FAILED) and
    failed result, or, with `retry`, the retry's requeue; registries and counters; with
    `end_stream`, the stream's "end" (failed)."""
    recorder = worker.connection.pipeline(transaction=False)
    job.heartbeat(job.ended_at or utcnow(), heartbeat_ttl_s, pipeline=recorder)
    if stopped or not retry:
        job.set_status(JobStatus.STOPPED if stopped else JobStatus.FAILED, pipeline=recorder)
    worker.cleanup_execution(job, pipeline=recorder, execution=execution)
    if not retry:
        job._handle_failure(exc_string, pipeline=recorder, worker_name=worker.name, execution_id=execution.id,
                            execution_started_at=execution.created_at, execution_ended_at=job.ended_at)
    worker.increment_failed_job_count(recorder)
    if job.started_at and job.ended_at:
        worker.increment_total_working_time(job.ended_at - job.started_at, recorder)
    if retry:
        job.retry(queue, recorder)
    if end_stream:
        publish_end(recorder, job.id, "failed", stream_ttl_s)
    return FencedWrite(job.key, execution.composite_key, recorder)


def requeue(worker: BaseWorker, entry: InFlight) -> FencedWrite:
    """A job the worker gives back unfinished (a drain ran out of time), at its queue's front."""
    recorder = worker.connection.pipeline(transaction=False)
    worker.cleanup_execution(entry.job, recorder, entry.execution)
    # As RQ's retry requeues (enqueue_job would open a transaction on the recorder).
    entry.queue._enqueue_job(entry.job, pipeline=recorder, at_front=True)
    return FencedWrite(entry.job.key, entry.execution.composite_key, recorder)
