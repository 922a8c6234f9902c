"""The api's view of jobs in Redis: enqueue, read back as a ResultResponse, cancel.

Two RQ queues: interactive requests, and batch lines (redis_schema.batch_queue_name), which
workers take only when the interactive queue is empty.

Blocking redis-py/RQ calls run in the api's threads (api.threads), except the enqueue of a
submission (JobStore.prepare() builds it, JobStore.enqueue() sends it) and the read of a
job with its latest result (JobStore.read()), which go from the event loop in the round
trip every request shares (api.shared_round_trip): a finished job's result, what most
reads are for, needs nothing else.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass

from redis import Redis
from redis.client import Pipeline
from rq import Queue, Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry
from rq.results import Result
from rq.scripts import _build_hset_args

from api.auth import ANYONE, Caller
from api.shared_round_trip import SharedRoundTrip
from pagedq.protocol import Completion, GenerateRequest, GenerationResult, JobPayload, ResultResponse, Timings, Usage
from pagedq.redis_schema import (
    ANNOUNCE_LUA,
    BODY_HASH_META_KEY,
    ENDED_KEY,
    ENDED_MAXLEN,
    JOB_FUNCTION,
    JOB_SERIALIZER,
    OWNER_META_KEY,
    WRITTEN_KEY,
    InvalidJob,
    JobState,
    Partial,
    batch_queue_name,
    cancels_key,
    decode_entries,
    failure_line,
    job_state,
    read_partial,
    read_progress,
    stream_key,
)
from pagedq.settings import Settings

# Cancels the given jobs that are still queued, and takes them out of their queue in one
# pass over it (an LREM per job would scan a long batch queue once per job).
# KEYS: the queue, its canceled registry, the job hashes. ARGV: the canceled status, the
# queued status, now, how long a canceled job is kept (redis_schema.EXPIRE_CANCELED_SCRIPT),
# the job ids.
_CANCEL_QUEUED = """
local gone, count = {}, 0
for i = 3, #KEYS do
    if redis.call('HGET', KEYS[i], 'status') == ARGV[2] then
        redis.call('HSET', KEYS[i], 'status', ARGV[1])
        redis.call('EXPIRE', KEYS[i], ARGV[4])
        redis.call('ZADD', KEYS[2], ARGV[3], ARGV[i + 2])
        gone[ARGV[i + 2]] = true
        count = count + 1
    end
end
if count > 0 then
    local ids = redis.call('LRANGE', KEYS[1], 0, -1)
    redis.call('DEL', KEYS[1])
    local keep = {}
    for _, id in ipairs(ids) do
        if not gone[id] then keep[#keep + 1] = id end
        if #keep == 1000 then redis.call('RPUSH', KEYS[1], unpack(keep)); keep = {} end
    end
    if #keep > 0 then redis.call('RPUSH', KEYS[1], unpack(keep)) end
end
return count
"""
_CANCEL_CHUNK = 2000
# Cancels one job in one step: a queued or running job becomes canceled (kept as long as a
# result, in its queue's canceled registry, out of its queue), its stream ends and the
# workers' cancel counter moves; a job that finished, failed or was canceled meanwhile is
# left as it is. One script, so a worker finishing the job at that moment either wins (the
# cancel finds it finished) or loses (its fenced success write finds it no longer started):
# never both, never an "end" twice. (RQ's job.cancel() reads, then writes.)
# KEYS: the job hash, its queue, its canceled registry, the cancel counter, its stream, the
# stream of ends, WRITTEN_KEY (where the stream's write is announced). ARGV: the job id,
# now, the job's TTL, the stream's TTL, the stream of ends' length, the canceled status,
# then the statuses a job can be canceled from.
# Returns the status the job had (false: no such job).
_CANCEL_ONE = ANNOUNCE_LUA + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
local cancelable = false
for i = 7, #ARGV do
    if status == ARGV[i] then cancelable = true end
end
if not cancelable then return status end
redis.call('HSET', KEYS[1], 'status', ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('LREM', KEYS[2], 1, ARGV[1])
redis.call('INCR', KEYS[4])
redis.call('XADD', KEYS[5], '*', 'type', 'end', 'status', 'canceled', 'finish_reason', 'abort')
redis.call('EXPIRE', KEYS[5], ARGV[4])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[5], '*', 'seq_id', ARGV[1])
announce(KEYS[7], KEYS[5])
return status
"""
_CANCELABLE = (JobStatus.CREATED, JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED, JobStatus.STARTED)
# One atomic step per submit: the duplicate check (Idempotency-Key), the queue-depth limit
# and the enqueue, so N concurrent submits against room for k accept exactly k. Writes
# what RQ's unique enqueue writes (the job hash from Job.to_dict(), its TTL, the push), and
# the queue's entry in RQ's set of queues.
# KEYS: the job hash, the queue, RQ's set of queues. ARGV: the job id, the depth limit, the
# job's TTL (-1: none), then the hash's field/value pairs. Returns 1 queued, 0 a job with
# this id exists, -1 the queue is full.
ENQUEUE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
    return 0
end
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[2]) then
    return -1
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
local ttl = tonumber(ARGV[3])
if ttl > 0 then
    redis.call('EXPIRE', KEYS[1], ttl)
end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], KEYS[2])
return 1
"""


class QueueFull(Exception):
    pass


class IdempotencyConflict(Exception):
    pass


class AlreadyFinished(Exception):
    pass


@dataclass(frozen=True)
class PreparedJob:
    """A submission ready to queue: ENQUEUE_SCRIPT's keys and arguments, and what its reply is judged by."""

    seq_id: str
    queue_name: str
    body_hash: str
    keys: list[str]
    args: list


@dataclass
class StoredJob:
    """A job as Redis holds it, and its latest result (RQ's results stream): read with it by
    JobStore.read(), else read (blocking) when first asked for."""

    job: Job
    latest: Result | None = None
    latest_read: bool = False

    @property
    def state(self) -> JobState:
        return job_state(self.job.get_status(refresh=False)) or "queued"

    def latest_result(self) -> Result | None:
        if not self.latest_read:
            self.latest, self.latest_read = self.job.latest_result(), True
        return self.latest

    def generation_result(self) -> GenerationResult:
        """A finished job's result (as RQ's Job.return_value() gives it)."""
        latest = self.latest_result()
        return GenerationResult.model_validate(_return_value(latest))


def _return_value(latest: Result | None):
    return latest.return_value if latest is not None and latest.type == Result.Type.SUCCESSFUL else None


def _restore_latest(seq_id: str, latest: list, connection: Redis | None) -> Result | None:
    """The job's latest result from the reply of XREVRANGE on its results stream, count 1."""
    return (Result.restore(seq_id, latest[0][0].decode(), latest[0][1], connection=connection, serializer=JOB_SERIALIZER)
            if latest else None)


async def read_finished_result(round_trip: SharedRoundTrip, seq_id: str) -> GenerationResult | None:
    """A finished job's result from RQ's results stream alone, read on the event loop; None
    when it has none (not finished, failed, deleted). No tenancy check: for a job the
    caller was let read already."""
    (latest,) = await round_trip.call(lambda pipeline: pipeline.xrevrange(Result.get_key(seq_id), count=1))
    value = _return_value(_restore_latest(seq_id, latest, None))
    return None if value is None else GenerationResult.model_validate(value)


def idempotent_seq_id(idempotency_key: str, owner: str) -> str:
    """The seq_id a key maps to; scoped by tenant so two tenants' keys never collide."""
    digest = hashlib.sha256(f"{owner}\0{idempotency_key}".encode()).hexdigest()
    return f"idem-{digest[:40]}"


class JobStore:
    def __init__(self, connection: Redis, settings: Settings, on_enqueued=lambda queue, count: None):
        """`on_enqueued(queue name, count)`: told of every enqueue (metrics)."""
        self.connection = connection
        self.settings = settings
        self.queue = Queue(settings.queue_name, connection=connection, serializer=JOB_SERIALIZER)
        self.batch_queue = Queue(batch_queue_name(settings.queue_name), connection=connection, serializer=JOB_SERIALIZER)
        self.on_enqueued = on_enqueued

    @staticmethod
    def payload(request: GenerateRequest, prompt_token_ids: list[int]) -> JobPayload:
        # Built from parts validated already (the request, its SamplingParams, the checked
        # prompt ids), so not validated a second time here; the worker validates what it reads.
        return JobPayload.model_construct(
            prompt=request.prompt,
            prompt_token_ids=prompt_token_ids,
            sampling=request.sampling_params(),
            beam=request.beam_search_params(),
            priority=request.priority,
            enqueued_at=time.time(),
            stream=request.stream,
        )

    def _new_job(self, queue: Queue, seq_id: str, payload: JobPayload, meta: dict, result_ttl_s: int) -> Job:
        return queue.create_job(
            JOB_FUNCTION,
            kwargs=payload.model_dump(mode="json"),
            job_id=seq_id,
            meta=meta,
            description=f"generate {seq_id}",  # not the prompt: descriptions end up in logs
            result_ttl=result_ttl_s,
            failure_ttl=result_ttl_s,
            timeout=self.settings.job_timeout_s,
            retry=Retry(max=self.settings.job_retries) if self.settings.job_retries else None,
        )

    def prepare(
        self, request: GenerateRequest, prompt_token_ids: list[int], idempotency_key: str | None, owner: str,
        body_hash: str | None = None,
    ) -> PreparedJob:
        """An interactive job for `owner` (a Caller's tenant), ready for one ENQUEUE_SCRIPT call
        (enqueue() sends it). `body_hash`: what a resubmission with its Idempotency-Key must
        match (replay()); by default the request's own."""
        body_hash = body_hash or hashlib.sha256(request.model_dump_json().encode()).hexdigest()
        seq_id = idempotent_seq_id(idempotency_key, owner) if idempotency_key else uuid.uuid4().hex
        job = self._new_job(
            self.queue, seq_id, self.payload(request, prompt_token_ids),
            {BODY_HASH_META_KEY: body_hash, OWNER_META_KEY: owner}, self.settings.result_ttl_s,
        )
        # What Queue.enqueue_job sets before saving (origin, enqueued_at, status queued).
        self.queue._prepare_for_queue(job)
        return PreparedJob(
            seq_id, self.queue.name, body_hash, keys=[job.key, self.queue.key, self.queue.redis_queues_keys],
            args=[job.id, self.settings.max_queue_depth, job.ttl if job.ttl is not None else -1, *_build_hset_args(job)],
        )

    @staticmethod
    async def enqueue(round_trip: SharedRoundTrip, prepared: PreparedJob) -> int:
        """ENQUEUE_SCRIPT's reply for `prepared` (settle() says what it means), in the
        shared round trip; a Redis error raises here, for this submission alone where
        Redis refused only its call. Each submission runs its own script call, atomic on
        its own (the idempotency check, the queue-depth limit, the push), in arrival order."""
        # EVAL, not EVALSHA: a pipeline of EVALSHA asks Redis first whether it has the
        # script (a second round trip), as it may have restarted.
        (reply,) = await round_trip.call(
            lambda pipeline: pipeline.eval(ENQUEUE_SCRIPT, len(prepared.keys), *prepared.keys, *prepared.args))
        return int(reply)

    def settle(self, prepared: PreparedJob, outcome: int) -> JobState | None:
        """What ENQUEUE_SCRIPT's `outcome` means for the job: "queued", QueueFull raised, or
        None when a job with its id exists already (an Idempotency-Key reused: replay())."""
        if outcome == 0:
            return None
        if outcome == -1:
            raise QueueFull(f"queue is full ({self.settings.max_queue_depth} jobs waiting); retry later")
        self.on_enqueued(prepared.queue_name, 1)
        return "queued"

    def enqueue_batch_line(
        self, pipeline: Pipeline, seq_id: str, payload: JobPayload, result_ttl_s: int, owner: str
    ) -> None:
        """Queue one batch line's job (the batch owner's) in the caller's transaction (which the caller runs)."""
        job = self._new_job(self.batch_queue, seq_id, payload, {OWNER_META_KEY: owner}, result_ttl_s)
        self.batch_queue.enqueue_job(job, pipeline=pipeline)

    def replay(self, prepared: PreparedJob) -> JobState:
        """A resubmission with a known Idempotency-Key: the same job, if the body is the same."""
        seq_id, body_hash = prepared.seq_id, prepared.body_hash
        job = self._fetch(seq_id)
        if job is None:  # expired between the two calls
            raise IdempotencyConflict("Idempotency-Key: the earlier job with this key just expired; retry")
        if job.meta.get(BODY_HASH_META_KEY) != body_hash:
            raise IdempotencyConflict("Idempotency-Key: already used with a different request body")
        return job_state(job.get_status(refresh=False)) or "queued"

    async def read(self, round_trip: SharedRoundTrip, seq_id: str, caller: Caller = ANYONE) -> StoredJob | None:
        """The job and its latest result, read in the shared round trip (from the event
        loop: no thread), restored by RQ's own parsers; None when there is no such job or
        it is another tenant's."""
        raw, latest = await round_trip.call(lambda pipeline: (
            pipeline.hgetall(Job.key_for(seq_id)), pipeline.xrevrange(Result.get_key(seq_id), count=1)))
        if not raw:
            return None
        job = Job(seq_id, connection=self.connection, serializer=JOB_SERIALIZER)
        try:
            job.restore(raw)  # as Job.fetch() restores what it reads
        except NoSuchJobError:
            return None
        if not caller.owns(job.meta.get(OWNER_META_KEY, "")):
            return None
        return StoredJob(job, _restore_latest(seq_id, latest, self.connection), latest_read=True)

    def snapshot(self, seq_id: str, caller: Caller) -> ResultResponse | None:
        """The job as GET /result shows it; None when there is no such job or it is another tenant's."""
        job = self._fetch(seq_id, caller)
        return None if job is None else self.snapshot_of(StoredJob(job))

    def snapshot_of(self, stored: StoredJob) -> ResultResponse:
        """GET /result's answer for a job; blocking (its stream is read) unless it finished."""
        job, state, seq_id = stored.job, stored.state, stored.job.id
        timings = Timings(
            enqueued=job.enqueued_at.timestamp() if job.enqueued_at else None,
            started=job.started_at.timestamp() if job.started_at and state != "queued" else None,
        )
        if state == "finished":
            result = stored.generation_result()
            return ResultResponse(
                seq_id=seq_id, status=state, text=result.text, token_ids=result.token_ids,
                finish_reason=result.finish_reason, prompt_logprobs=result.prompt_logprobs, completions=result.completions,
                beams=result.beams, usage=result.usage, timings=result.timings,
            )
        progress = read_progress(job)
        # Nothing in the stream before the job first starts.
        partial = (read_partial(decode_entries(self.connection.xrange(stream_key(seq_id))))
                   if progress.attempt or state != "queued" else Partial())
        timings.first_token = partial.first_token
        payload = _payload(job)
        usage = None
        if progress.attempt or state == "running":
            # A job just started may not have its first progress written yet: its payload knows the prompt.
            prompt_tokens = progress.prompt_tokens or (len(payload.prompt_token_ids) if payload is not None else 0)
            usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=partial.completion_tokens)
        first = partial.output(0)
        response = ResultResponse(
            seq_id=seq_id, status=state, text=first.text, token_ids=first.token_ids, timings=timings, usage=usage,
        )
        if state == "canceled":
            response.finish_reason = "abort"
        elif state == "failed":
            response.error = failure_text(stored.latest_result())
            timings.finished = job.ended_at.timestamp() if job.ended_at else None
        if payload is not None and payload.beam is None and payload.sampling.n > 1:
            # Every sample so far, as a finished job's `completions` shows them (beams come only at the end).
            response.completions = [
                Completion(index=index, text=output.text, token_ids=output.token_ids, cumulative_logprob=None,
                           finish_reason=response.finish_reason)
                for index, output in ((index, partial.output(index)) for index in range(payload.sampling.n))
            ]
        return response

    def cancel(self, seq_id: str, caller: Caller) -> ResultResponse | None:
        job = self._fetch(seq_id, caller)
        if job is None:
            return None
        status = self._cancel(self.connection, job)
        if status is None:
            return None  # expired meanwhile
        state = job_state(JobStatus(status.decode()))
        if state in ("finished", "failed"):
            raise AlreadyFinished(f"job {seq_id} already {state}; nothing to cancel")
        # A running job's worker notices within one engine step; the stream ended now.
        return self.snapshot(seq_id, caller)

    def _cancel(self, client, job: Job):
        """_CANCEL_ONE for one job, on a connection or a pipeline."""
        queue = Queue(job.origin, connection=self.connection, serializer=JOB_SERIALIZER)
        registry = CanceledJobRegistry(job.origin, connection=self.connection, serializer=JOB_SERIALIZER)
        keys = [job.key, queue.key, registry.key, cancels_key(self.settings.queue_name), stream_key(job.id), ENDED_KEY,
                WRITTEN_KEY]
        args = [job.id, time.time(), self.settings.result_ttl_s, self.settings.stream_ttl_s, ENDED_MAXLEN,
                JobStatus.CANCELED.value, *(status.value for status in _CANCELABLE)]
        # EVAL, not EVALSHA: a pipeline cannot reload a script a restarted Redis forgot.
        return client.eval(_CANCEL_ONE, len(keys), *keys, *args)

    def cancel_many(self, seq_ids: list[str]) -> None:
        """Cancel many jobs at once (a batch's lines): queued ones never run (no stream
        "end" events for them: relays notice the canceled status by themselves), running
        ones are aborted by their worker within a step."""
        jobs = [job for job in Job.fetch_many(seq_ids, self.connection, serializer=JOB_SERIALIZER) if job is not None]
        running = []
        by_queue: dict[str, list[Job]] = {}
        for job in jobs:
            state = job_state(job.get_status(refresh=False))
            if state == "running":
                running.append(job)
            elif state == "queued":
                by_queue.setdefault(job.origin, []).append(job)
        for origin, queued in by_queue.items():
            registry = CanceledJobRegistry(origin, connection=self.connection, serializer=JOB_SERIALIZER)
            queue_key = Queue(origin, connection=self.connection, serializer=JOB_SERIALIZER).key
            for start in range(0, len(queued), _CANCEL_CHUNK):
                chunk = queued[start:start + _CANCEL_CHUNK]
                self.connection.eval(
                    _CANCEL_QUEUED, 2 + len(chunk), queue_key, registry.key, *(job.key for job in chunk),
                    JobStatus.CANCELED.value, JobStatus.QUEUED.value, time.time(), self.settings.result_ttl_s,
                    *(job.id for job in chunk),
                )
        if running:
            with self.connection.pipeline(transaction=False) as pipeline:
                for job in running:
                    self._cancel(pipeline, job)  # a job that ended meanwhile stays as it ended
                pipeline.execute()

    async def outcome(self, round_trip: SharedRoundTrip, seq_id: str) -> tuple[JobState | None, GenerationResult | None, str | None]:
        """A job's state, with its result when finished or its error when failed, read on the
        event loop (the api's own reading of a job it just made for the caller: no tenancy check)."""
        stored = await self.read(round_trip, seq_id)
        if stored is None:
            return None, None, None
        return self.outcome_of(stored)

    def job_outcome(self, job: Job) -> tuple[JobState, GenerationResult | None, str | None]:
        return self.outcome_of(StoredJob(job))

    @staticmethod
    def outcome_of(stored: StoredJob) -> tuple[JobState, GenerationResult | None, str | None]:
        state = stored.state
        if state == "finished":
            return state, stored.generation_result(), None
        return state, None, failure_text(stored.latest_result()) if state == "failed" else None

    def _fetch(self, seq_id: str, caller: Caller = ANYONE) -> Job | None:
        """The job, if it exists and the caller may see it: another tenant's job is as absent as none."""
        try:
            job = Job.fetch(seq_id, connection=self.connection, serializer=JOB_SERIALIZER)
        except NoSuchJobError:
            return None
        return job if caller.owns(job.meta.get(OWNER_META_KEY, "")) else None

    @staticmethod
    def failure_message(job: Job) -> str:
        return failure_text(job.latest_result())


def failure_text(result: Result | None) -> str:
    """A failed job's message from its latest result: the exception's own line, not the worker's traceback."""
    exc_string = (result.exc_string if result is not None else None) or ""
    lines = [line for line in exc_string.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "job failed"


def invalid_input(failure: str | None) -> str | None:
    """The client-facing message of a job that failed on its input (the client's error, a
    4xx), or None for any other failure (the server's, a 5xx)."""
    prefix = failure_line(InvalidJob)
    return failure.removeprefix(prefix) if failure and failure.startswith(prefix) else None


def _payload(job: Job) -> JobPayload | None:
    """The job's payload; None for one no worker would run (it breaks the input rules)."""
    try:
        return JobPayload.read(job.kwargs)
    except InvalidJob:
        return None
