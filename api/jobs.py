"""The api's view of jobs in Redis: enqueue, read back as a ResultResponse, cancel.

Blocking redis-py/RQ calls: FastAPI runs these endpoints in its threadpool.
"""

from __future__ import annotations

import hashlib
import time
import uuid

from redis import Redis
from rq import Queue, Retry
from rq.exceptions import DuplicateJobError, InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from pagedq.protocol import (
    JOB_FUNCTION,
    GenerateRequest,
    GenerationResult,
    JobPayload,
    JobState,
    Progress,
    PROGRESS_META_KEY,
    ResultResponse,
    Timings,
    Usage,
    cancels_key,
)
from pagedq.settings import Settings
from worker.publisher import publish_end

STATES: dict[str, JobState] = {
    JobStatus.QUEUED: "queued",
    JobStatus.DEFERRED: "queued",
    JobStatus.SCHEDULED: "queued",
    JobStatus.CREATED: "queued",
    JobStatus.STARTED: "running",
    JobStatus.FINISHED: "finished",
    JobStatus.FAILED: "failed",
    JobStatus.STOPPED: "failed",
    JobStatus.CANCELED: "canceled",
}
TERMINAL: frozenset[JobState] = frozenset({"finished", "failed", "canceled"})
_BODY_HASH_META_KEY = "request_sha256"


class QueueFull(Exception):
    pass


class IdempotencyConflict(Exception):
    pass


class AlreadyFinished(Exception):
    pass


def job_state(rq_status: str | bytes | None) -> JobState | None:
    if rq_status is None:
        return None
    return STATES.get(rq_status.decode() if isinstance(rq_status, bytes) else rq_status, "queued")


def idempotent_seq_id(idempotency_key: str, api_key: str) -> str:
    """The seq_id a key maps to; scoped by API key so two clients' keys never collide."""
    digest = hashlib.sha256(f"{api_key}\0{idempotency_key}".encode()).hexdigest()
    return f"idem-{digest[:40]}"


class JobStore:
    def __init__(self, connection: Redis, settings: Settings):
        self.connection = connection
        self.settings = settings
        self.queue = Queue(settings.queue_name, connection=connection, serializer=JSONSerializer)

    def submit(
        self, request: GenerateRequest, prompt_token_ids: list[int], idempotency_key: str | None, api_key: str
    ) -> tuple[str, JobState]:
        if self.queue.count >= self.settings.max_queue_depth:
            raise QueueFull(f"queue is full ({self.settings.max_queue_depth} jobs waiting); retry later")
        body_hash = hashlib.sha256(request.model_dump_json().encode()).hexdigest()
        seq_id = idempotent_seq_id(idempotency_key, api_key) if idempotency_key else uuid.uuid4().hex
        payload = JobPayload(
            prompt=request.prompt,
            prompt_token_ids=prompt_token_ids,
            sampling=request.sampling_params(),
            beam=request.beam_search_params(),
            priority=request.priority,
            enqueued_at=time.time(),
        )
        try:
            self.queue.enqueue(
                JOB_FUNCTION,
                kwargs=payload.model_dump(mode="json"),
                job_id=seq_id,
                unique=True,
                meta={_BODY_HASH_META_KEY: body_hash},
                description=f"generate {seq_id}",  # not the prompt: descriptions end up in logs
                result_ttl=self.settings.result_ttl_s,
                failure_ttl=self.settings.result_ttl_s,
                job_timeout=self.settings.job_timeout_s,
                retry=Retry(max=self.settings.job_retries) if self.settings.job_retries else None,
            )
        except DuplicateJobError:
            return seq_id, self._replay(seq_id, body_hash)
        return seq_id, "queued"

    def _replay(self, seq_id: str, body_hash: str) -> JobState:
        """A resubmission with a known Idempotency-Key: the same job, if the body is the same."""
        job = self._fetch(seq_id)
        if job is None:  # expired between the two calls
            raise IdempotencyConflict("Idempotency-Key: the earlier job with this key just expired; retry")
        if job.meta.get(_BODY_HASH_META_KEY) != body_hash:
            raise IdempotencyConflict("Idempotency-Key: already used with a different request body")
        return job_state(job.get_status(refresh=False)) or "queued"

    def exists(self, seq_id: str) -> bool:
        return bool(self.connection.exists(Job.key_for(seq_id)))

    def snapshot(self, seq_id: str) -> ResultResponse | None:
        job = self._fetch(seq_id)
        if job is None:
            return None
        state = job_state(job.get_status(refresh=False)) or "queued"
        timings = Timings(
            enqueued=job.enqueued_at.timestamp() if job.enqueued_at else None,
            started=job.started_at.timestamp() if job.started_at and state != "queued" else None,
        )
        if state == "finished":
            result = GenerationResult.model_validate(job.return_value())
            return ResultResponse(
                seq_id=seq_id, status=state, text=result.text, token_ids=result.token_ids,
                finish_reason=result.finish_reason, beams=result.beams, usage=result.usage, timings=result.timings,
            )
        progress = Progress.model_validate(job.meta.get(PROGRESS_META_KEY) or {})
        timings.first_token = progress.first_token
        response = ResultResponse(
            seq_id=seq_id, status=state, text=progress.text, token_ids=progress.token_ids, timings=timings,
            usage=Usage(prompt_tokens=progress.prompt_tokens, completion_tokens=len(progress.token_ids))
            if progress.attempt else None,
        )
        if state == "canceled":
            response.finish_reason = "abort"
        elif state == "failed":
            response.error = self._failure_message(job)
            timings.finished = job.ended_at.timestamp() if job.ended_at else None
        return response

    def cancel(self, seq_id: str) -> ResultResponse | None:
        job = self._fetch(seq_id)
        if job is None:
            return None
        state = job_state(job.get_status(refresh=False))
        if state in ("finished", "failed"):
            raise AlreadyFinished(f"job {seq_id} already {state}; nothing to cancel")
        if state != "canceled":
            try:
                job.cancel()
            except InvalidJobOperation:
                pass  # canceled concurrently: the outcome is the same
            # A running job's worker notices within one engine step; the stream ends now.
            with self.connection.pipeline(transaction=False) as pipeline:
                pipeline.incr(cancels_key(self.settings.queue_name))
                publish_end(pipeline, seq_id, "canceled", self.settings.stream_ttl_s, finish_reason="abort")
                pipeline.execute()
        return self.snapshot(seq_id)

    def _fetch(self, seq_id: str) -> Job | None:
        try:
            return Job.fetch(seq_id, connection=self.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            return None

    @staticmethod
    def _failure_message(job: Job) -> str:
        result = job.latest_result()
        exc_string = (result.exc_string if result is not None else None) or ""
        # The exception's own line, not the worker's traceback.
        lines = [line for line in exc_string.strip().splitlines() if line.strip()]
        return lines[-1] if lines else "job failed"
