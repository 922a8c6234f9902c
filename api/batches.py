"""The Batch API: POST /v1/batches, GET /v1/batches[/{id}], POST /v1/batches/{id}/cancel.

A batch's state lives in Redis only, so any api replica serves it and restarts lose nothing:
- the record (OpenAI's batch object plus how far the input has been read);
- per input line: its custom_id, and, for a line that cannot run, its error-file line;
- per line job: its outcome, once seen (finished, failed, canceled).

Each valid line becomes an ordinary job, id `<batch id>-<line>`, in the batch queue at
`batch_priority`: workers take it only when no interactive request waits (and never into
the slots reserved for those). Lines are read and their jobs queued a chunk at a time,
each chunk in one transaction with the record's read position, so a fan-out interrupted
anywhere resumes where it stopped and never queues a line twice.

Progress is pulled, not pushed: `advance()` reads the status of the jobs not yet seen to
end and records their outcomes (idempotently, by line), so the counts stay exact whatever
ran a job and however often (a worker killed mid-job, RQ's retries, a plain `rq worker`).
When nothing is left pending the output and error files are written from the jobs'
results and the batch ends. Every api process runs `supervise()`, which advances every
active batch every `batch_poll_interval_s`; a lease per batch keeps replicas from doing the
same work twice, and a GET advances it too. Line jobs keep their results for the
completion window on top of `result_ttl_s`, so results outlive the batch's window.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from api.auth import ANYONE, Caller, authenticate
from api.errors import ApiError, openai_error_body
from api.files import FileConflict, FileStore
from api.jobs import JobStore, invalid_input
from api.openai_compat import REQUEST_MODELS, OpenAITranslator
from api.threads import blocking
from pagedq.protocol import JobPayload
from pagedq.redis_connection import passing_redis_trouble
from pagedq.redis_schema import ACTIVE_BATCHES_KEY, BATCHES_KEY, TERMINAL, batch_key, job_state, tenant_batches_key
from pagedq.request_rules import MAX_JSON_DEPTH, ValidInput, json_too_deep
from pagedq.settings import Settings

log = logging.getLogger("pagedq.api")

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]
ACTIVE: frozenset[str] = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
COMPLETION_WINDOWS = {"24h": 24 * 3600}
BATCH_ID_PATTERN = re.compile(r"^batch_[0-9a-f]{32}$")
_CHUNK_LINES = 256
_LEASE_S = 60
# Deletes a lease only if it is still ours. KEYS: the lease. ARGV: our token.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchUsage(BaseModel):
    """OpenAI's batch usage: the tokens of the requests that completed."""

    input_tokens: int = 0
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int = 0
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int = 0


class BatchObject(BaseModel):
    """OpenAI's batch object."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: dict | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    # Set when the batch ends (it sums the completed requests' usage from their results).
    usage: BatchUsage | None = None
    metadata: dict[str, str] | None = None


class BatchRecord(BatchObject):
    """What Redis keeps: the batch object plus the fan-out's position."""

    lines_read: int = 0
    request_sha256: str
    # The tenant that created it (api.auth.Caller.tenant); its line jobs and files are that tenant's too.
    owner: str = ""

    def public(self) -> dict:
        return BatchObject.model_validate(self.model_dump(exclude={"lines_read", "request_sha256", "owner"})).model_dump()


class BatchCreate(ValidInput):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: dict | None = Field(None, description="Accepted; output files expire with PAGEDQ_FILES_TTL_S.")


def line_job_id(batch_id: str, index: int) -> str:
    return f"{batch_id}-{index}"


def _error_line(batch_id: str, index: int, custom_id: str | None, code: str, message: str) -> str:
    """A line that never produced an HTTP-style response (OpenAI's `error` field)."""
    return json.dumps({"id": f"batch_req_{line_job_id(batch_id, index)}", "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}})


def _response_line(batch_id: str, index: int, custom_id: str | None, status_code: int, body: dict) -> str:
    request_id = line_job_id(batch_id, index)
    return json.dumps({"id": f"batch_req_{request_id}", "custom_id": custom_id,
                       "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None})


class BatchStore:
    def __init__(self, connection: Redis, settings: Settings, jobs: JobStore, files: FileStore, translator: OpenAITranslator):
        self.connection = connection
        self.settings = settings
        self.jobs = jobs
        self.files = files
        self.translator = translator

    # ---- records ------------------------------------------------------------------------

    def get(self, batch_id: str, caller: Caller = ANYONE) -> BatchRecord | None:
        """The batch, if the caller may see it: another tenant's batch is as absent as none."""
        if not BATCH_ID_PATTERN.match(batch_id):
            return None  # not an id this api makes (and "<id>:lines" names another of its keys)
        raw = self.connection.get(batch_key(batch_id))
        record = BatchRecord.model_validate_json(raw) if raw else None
        return record if record is not None and caller.owns(record.owner) else None

    def _save(self, record: BatchRecord, pipeline=None) -> None:
        (pipeline or self.connection).set(batch_key(record.id), record.model_dump_json(), ex=self.settings.files_ttl_s)

    def list(self, limit: int, after: str | None, caller: Caller) -> tuple[list[BatchRecord], bool]:
        """The caller's batches (an admin's: everyone's), newest first; `after`: the last id of the previous page."""
        key = BATCHES_KEY if caller.admin else tenant_batches_key(caller.tenant)
        start = 0
        if after is not None:
            rank = self.connection.zrevrank(key, after)
            start = rank + 1 if rank is not None else 0
        ids = [i.decode() for i in self.connection.zrevrange(key, start, start + limit)]
        records = [self.get(batch_id) for batch_id in ids]
        gone = [batch_id for batch_id, record in zip(ids, records) if record is None]
        if gone:
            self.connection.zrem(key, *gone)  # expired
        present = [record for record in records if record is not None]
        return present[:limit], len(ids) > limit

    def create(self, body: BatchCreate, idempotency_key: str | None, caller: Caller) -> BatchRecord:
        if body.endpoint not in REQUEST_MODELS:
            raise ApiError(400, f"endpoint: one of {', '.join(REQUEST_MODELS)}, got {body.endpoint!r}", param="endpoint")
        if body.completion_window not in COMPLETION_WINDOWS:
            raise ApiError(400, f"completion_window: one of {', '.join(COMPLETION_WINDOWS)}, got {body.completion_window!r}",
                           param="completion_window")
        stored = self.files.get(body.input_file_id)
        if stored is None or not caller.owns(stored.owner):
            raise ApiError(404, f"input_file_id: no file {body.input_file_id!r}", param="input_file_id", code="file_not_found")
        if stored.purpose != "batch":
            raise ApiError(400, f"input_file_id: file {body.input_file_id} has purpose {stored.purpose!r}, not 'batch'",
                           param="input_file_id")
        request_sha256 = hashlib.sha256(body.model_dump_json().encode()).hexdigest()
        if idempotency_key:
            digest = hashlib.sha256(f"batch\0{caller.tenant}\0{idempotency_key}".encode()).hexdigest()
            batch_id = f"batch_{digest[:32]}"
        else:
            batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(time.time())
        record = BatchRecord(
            id=batch_id, endpoint=body.endpoint, model=self.translator.model_id, input_file_id=body.input_file_id,
            completion_window=body.completion_window, status="validating", created_at=now,
            expires_at=now + COMPLETION_WINDOWS[body.completion_window], metadata=body.metadata,
            request_sha256=request_sha256, owner=caller.tenant,
        )
        if self.connection.set(batch_key(batch_id), record.model_dump_json(), nx=True, ex=self.settings.files_ttl_s):
            with self.connection.pipeline() as pipeline:
                pipeline.zadd(BATCHES_KEY, {batch_id: time.time()})
                pipeline.zadd(tenant_batches_key(caller.tenant), {batch_id: time.time()})
                pipeline.expire(tenant_batches_key(caller.tenant), self.settings.files_ttl_s)
                pipeline.sadd(ACTIVE_BATCHES_KEY, batch_id)
                pipeline.execute()
        else:
            existing = self.get(batch_id, caller)
            if existing is None or existing.request_sha256 != request_sha256:
                raise ApiError(409, "Idempotency-Key: already used for a different batch", code="idempotency_conflict")
        # Runs (or resumes) the fan-out now, so the answer says which lines were accepted.
        return self.advance(batch_id, wait_s=30.0) or record

    def request_cancel(self, batch_id: str) -> BatchRecord | None:
        record = self.get(batch_id)
        if record is None:
            return None
        if record.status in ("cancelling", "cancelled"):
            return record
        if record.status not in ACTIVE:
            raise ApiError(409, f"batch {batch_id} is {record.status}; nothing to cancel", code="batch_not_active")
        # The flag reaches a replica busy with this batch (it looks between chunks and steps).
        self.connection.set(batch_key(batch_id, "cancel"), "1", ex=self.settings.files_ttl_s)
        with self._lease(batch_id, wait_s=5.0) as held:
            record = self.get(batch_id) or record
            if record.status in ("validating", "in_progress"):
                record.status, record.cancelling_at = "cancelling", int(time.time())
                if held:
                    self._save(record)
                    pending = self._refresh(record)
                    self.jobs.cancel_many([line_job_id(batch_id, index) for index in pending])
                    self._save(record)
        # "cancelled" once an advance has seen every line end (the supervisor's next round, or a GET).
        return record

    # ---- progress -----------------------------------------------------------------------

    @contextmanager
    def _lease(self, batch_id: str, wait_s: float) -> Iterator[bool]:
        key, token = batch_key(batch_id, "lease"), uuid.uuid4().hex
        deadline = time.monotonic() + wait_s
        while not (held := bool(self.connection.set(key, token, nx=True, ex=_LEASE_S))) and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            yield held
        finally:
            if held:
                self.connection.eval(_RELEASE, 1, key, token)

    def _renew_lease(self, batch_id: str) -> None:
        self.connection.expire(batch_key(batch_id, "lease"), _LEASE_S)

    def advance(self, batch_id: str, wait_s: float = 0.0) -> BatchRecord | None:
        """Take the batch as far as it can go now; the record as it then is (as stored, when
        another replica holds the batch)."""
        with self._lease(batch_id, wait_s) as held:
            record = self.get(batch_id)
            if not held or record is None or record.status not in ACTIVE:
                if record is None or record.status not in ACTIVE:
                    self.connection.srem(ACTIVE_BATCHES_KEY, batch_id)
                return record
            cancel = bool(self.connection.exists(batch_key(batch_id, "cancel")))
            if cancel and record.status in ("validating", "in_progress"):
                record.status, record.cancelling_at = "cancelling", int(time.time())
                self._save(record)
            if record.status == "validating":
                self._fan_out(record)
            if record.status in ("in_progress", "cancelling", "finalizing"):
                pending = self._refresh(record)
                expiring = record.status == "in_progress" and time.time() >= record.expires_at
                if pending and (record.status == "cancelling" or expiring):
                    # Repeated each advance: a line taken by a worker mid-cancel is caught next time.
                    self.jobs.cancel_many([line_job_id(batch_id, index) for index in pending])
                    if expiring and record.expired_at is None:
                        record.expired_at = int(time.time())
                    pending = self._refresh(record)
                if not pending:
                    self._finalize(record)
            self._save(record)
            if record.status not in ACTIVE:
                self.connection.srem(ACTIVE_BATCHES_KEY, batch_id)
            return record

    def _fail(self, record: BatchRecord, code: str, message: str) -> None:
        record.status, record.failed_at = "failed", int(time.time())
        record.errors = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}

    def _fan_out(self, record: BatchRecord) -> None:
        """Read the input's lines from where the last reading stopped; queue a job per valid
        line and keep an error line for each invalid one, a chunk per transaction."""
        if self.files.get(record.input_file_id) is None:
            self._fail(record, "file_not_found", f"input file {record.input_file_id} is gone")
            return
        if record.lines_read == 0:
            requests = sum(1 for line in self.files.lines(record.input_file_id) if line.strip())
            if requests == 0:
                self._fail(record, "empty_file", "the input file has no requests")
                return
            if requests > self.settings.max_batch_requests:
                self._fail(record, "too_many_requests", f"the input file has {requests} requests, more than the limit "
                           f"of {self.settings.max_batch_requests} (PAGEDQ_MAX_BATCH_REQUESTS)")
                return
        seen = {json.loads(value) for value in self.connection.hvals(batch_key(record.id, "lines"))}
        chunk: list[tuple[int, str | None, str | None, object]] = []
        for index, raw in enumerate(self.files.lines(record.input_file_id)):
            if index < record.lines_read:
                continue
            if raw.strip():
                try:
                    custom_id, error, payload = self._line(record, index, raw, seen)
                except Exception:  # a line's fault, whatever it is, is that line's error alone
                    log.exception("batch %s: line %d could not be read", record.id, index + 1)
                    custom_id, payload = None, None
                    error = _error_line(record.id, index, None, "internal_error", f"line {index + 1}: could not be read")
                seen.add(custom_id)
                chunk.append((index, custom_id, error, payload))
            if len(chunk) >= _CHUNK_LINES:
                self._commit(record, chunk, index + 1)
                chunk = []
                if self.connection.exists(batch_key(record.id, "cancel")):
                    record.status, record.cancelling_at = "cancelling", int(time.time())
                    self._save(record)
                    return
        self._commit(record, chunk, record.lines_read if not chunk else chunk[-1][0] + 1)
        record.status, record.in_progress_at = "in_progress", int(time.time())

    def _line(self, record: BatchRecord, index: int, raw: bytes, seen: set):
        """(custom_id, error line or None, job payload or None) of one input line."""
        if json_too_deep(raw):
            return None, _error_line(record.id, index, None, "invalid_json",
                                     f"line {index + 1}: nested more than {MAX_JSON_DEPTH} levels deep"), None
        try:
            line = json.loads(raw)
        except ValueError as exc:
            return None, _error_line(record.id, index, None, "invalid_json", f"line {index + 1}: not JSON ({exc})"), None
        if not isinstance(line, dict):
            return None, _error_line(record.id, index, None, "invalid_request", f"line {index + 1}: not a JSON object"), None
        custom_id = line.get("custom_id")
        problem = None
        if not isinstance(custom_id, str) or not custom_id:
            custom_id, problem = None, "custom_id: a non-empty string is required"
        elif custom_id in seen:
            problem = f"custom_id: {custom_id!r} is used by an earlier line"
        elif line.get("method") != "POST":
            problem = f"method: must be 'POST', got {line.get('method')!r}"
        elif line.get("url") != record.endpoint:
            problem = f"url: must be the batch's endpoint {record.endpoint!r}, got {line.get('url')!r}"
        elif not isinstance(line.get("body"), dict):
            problem = "body: a JSON object is required"
        elif set(line) - {"custom_id", "method", "url", "body"}:
            problem = f"unknown fields: {', '.join(sorted(set(line) - {'custom_id', 'method', 'url', 'body'}))}"
        if problem is not None:
            return custom_id, _error_line(record.id, index, custom_id, "invalid_request", f"line {index + 1}: {problem}"), None
        try:
            body = self.translator.parse(record.endpoint, line["body"])
            if body.stream:
                raise ApiError(400, "stream: not available in a batch", param="stream")
            prepared = self.translator.prepare(record.endpoint, body)
            if len(prepared) != 1:
                raise ApiError(400, f"prompt: one prompt per batch line, got {len(prepared)}", param="prompt")
            ((request, prompt_token_ids),) = prepared
            request.priority = self.settings.batch_priority
        except ApiError as exc:
            error = openai_error_body(exc.status_code, str(exc.detail), exc.param, exc.code)
            return custom_id, _response_line(record.id, index, custom_id, exc.status_code, error), None
        return custom_id, None, JobStore.payload(request, prompt_token_ids, stream=False)

    def _commit(self, record: BatchRecord, chunk: list, lines_read: int) -> None:
        record.lines_read = lines_read
        # The results must outlive the batch's window (and its finalizing, which reads them).
        result_ttl_s = self.settings.result_ttl_s + COMPLETION_WINDOWS[record.completion_window]
        ttl = self.settings.files_ttl_s
        queued = 0
        with self.connection.pipeline() as pipeline:
            pipeline.multi()
            for index, custom_id, error, payload in chunk:
                pipeline.hset(batch_key(record.id, "lines"), str(index), json.dumps(custom_id))
                if error is not None:
                    pipeline.hset(batch_key(record.id, "errors"), str(index), error)
                else:
                    self.jobs.enqueue_batch_line(pipeline, line_job_id(record.id, index), payload, result_ttl_s, record.owner)
                    queued += 1
            for part in ("lines", "errors"):
                pipeline.expire(batch_key(record.id, part), ttl)
            self._save(record, pipeline)
            pipeline.execute()
        self._renew_lease(record.id)
        if queued:
            self.jobs.on_enqueued(self.jobs.batch_queue.name, queued)

    def _refresh(self, record: BatchRecord) -> list[int]:
        """Record the outcomes of line jobs that ended since last time; update the counts;
        the lines still pending."""
        lines_key, errors_key, outcomes_key = (batch_key(record.id, part) for part in ("lines", "errors", "outcomes"))
        with self.connection.pipeline(transaction=False) as pipeline:
            pipeline.hkeys(lines_key)
            pipeline.hkeys(errors_key)
            pipeline.hgetall(outcomes_key)
            lines, errors, outcomes = pipeline.execute()
        invalid = {int(i) for i in errors}
        outcomes = {int(i): o.decode() for i, o in outcomes.items()}
        pending = sorted({int(i) for i in lines} - invalid - set(outcomes))
        if pending:
            with self.connection.pipeline(transaction=False) as pipeline:
                for index in pending:
                    pipeline.hget(Job.key_for(line_job_id(record.id, index)), "status")
                statuses = pipeline.execute()
            ended = {}
            for index, status in zip(pending, statuses):
                state = job_state(status)
                if state is None:
                    ended[index] = "failed"  # the job is gone (deleted by hand)
                elif state in TERMINAL:
                    ended[index] = state
            if ended:
                with self.connection.pipeline(transaction=False) as pipeline:
                    pipeline.hset(outcomes_key, mapping={str(i): o for i, o in ended.items()})
                    pipeline.expire(outcomes_key, self.settings.files_ttl_s)
                    pipeline.execute()
                outcomes.update(ended)
                pending = [index for index in pending if index not in ended]
        done = list(outcomes.values())
        record.request_counts = RequestCounts(
            total=len(lines), completed=done.count("finished"), failed=len(invalid) + done.count("failed"),
        )
        return pending

    def _finalize(self, record: BatchRecord) -> None:
        """Every line has ended: write the output and error files, end the batch."""
        record.status, record.finalizing_at = "finalizing", int(time.time())
        self._save(record)
        with self.connection.pipeline(transaction=False) as pipeline:
            pipeline.hgetall(batch_key(record.id, "lines"))
            pipeline.hgetall(batch_key(record.id, "errors"))
            pipeline.hgetall(batch_key(record.id, "outcomes"))
            lines, errors, outcomes = pipeline.execute()
        custom_ids = {int(i): json.loads(c) for i, c in lines.items()}
        errors = {int(i): e.decode() for i, e in errors.items()}
        outcomes = {int(i): o.decode() for i, o in outcomes.items()}
        finished = sorted(i for i, outcome in outcomes.items() if outcome == "finished")
        expired: list[int] = []  # finished, but their results are gone
        record.usage = BatchUsage()
        if finished:
            output = self._output_lines(record, finished, custom_ids, expired, record.usage)
            record.output_file_id = self._write(record, "output", output)
        unfinished = sorted(set(errors) | {i for i, outcome in outcomes.items() if outcome != "finished"} | set(expired))
        if unfinished:
            lines_iter = self._error_lines(record, unfinished, custom_ids, errors, outcomes)
            record.error_file_id = self._write(record, "errors", lines_iter)
        now = int(time.time())
        if record.cancelling_at is not None:
            record.status, record.cancelled_at = "cancelled", now
        elif record.expired_at is not None:
            record.status = "expired"
        else:
            record.status, record.completed_at = "completed", now

    def _write(self, record: BatchRecord, kind: str, lines: Iterator[str]) -> str:
        file_id = f"file-{record.id}-{kind}"
        chunks = (line.encode() + b"\n" for line in lines)
        try:
            return self.files.create(chunks, f"{record.id}_{kind}.jsonl", "batch_output", record.owner, file_id).id
        except FileConflict:
            # Written by an earlier finalizing of this batch, since when results expired: keep it.
            return file_id

    def _jobs(self, record: BatchRecord, indices: list[int]) -> Iterator[tuple[int, Job | None]]:
        for start in range(0, len(indices), _CHUNK_LINES):
            chunk = indices[start:start + _CHUNK_LINES]
            ids = [line_job_id(record.id, index) for index in chunk]
            yield from zip(chunk, Job.fetch_many(ids, self.connection, serializer=JSONSerializer))
            self._renew_lease(record.id)

    def _output_lines(self, record: BatchRecord, finished: list[int], custom_ids: dict, expired: list[int],
                      usage: BatchUsage) -> Iterator[str]:
        """The output file's lines; adds each request's tokens to `usage`."""
        for index, job in self._jobs(record, finished):
            result = self.jobs.job_outcome(job)[1] if job is not None else None
            if result is None:
                expired.append(index)  # for the error file
                continue
            usage.input_tokens += result.usage.prompt_tokens
            usage.output_tokens += result.usage.completion_tokens
            usage.total_tokens = usage.input_tokens + usage.output_tokens
            logprobs = JobPayload.model_validate(job.kwargs).sampling.logprobs
            body = self.translator.response(record.endpoint, line_job_id(record.id, index), [result], logprobs)
            yield _response_line(record.id, index, custom_ids.get(index), 200, body)

    def _error_lines(self, record: BatchRecord, unfinished: list[int], custom_ids: dict, errors: dict,
                     outcomes: dict) -> Iterator[str]:
        for index in unfinished:
            custom_id = custom_ids.get(index)
            if index in errors:
                yield errors[index]
            elif outcomes[index] == "finished":
                yield _error_line(record.id, index, custom_id, "result_expired",
                                  "the request finished, but its result expired before the batch was finalized")
            elif outcomes[index] == "canceled":
                code = "batch_expired" if record.expired_at is not None and record.cancelling_at is None else "batch_cancelled"
                yield _error_line(record.id, index, custom_id, code, f"the batch was {code.removeprefix('batch_')} "
                                  "before this request ran to the end")
            else:
                job = Job.fetch_many([line_job_id(record.id, index)], self.connection, serializer=JSONSerializer)[0]
                message = JobStore.failure_message(job) if job is not None else "the job is gone"
                if (invalid := invalid_input(message)) is not None:
                    yield _response_line(record.id, index, custom_id, 400,
                                         openai_error_body(400, invalid, code="invalid_request"))
                else:
                    yield _response_line(record.id, index, custom_id, 500,
                                         openai_error_body(500, f"the request failed: {message}", code="job_failed"))


async def supervise(app: FastAPI) -> None:
    """Advance every active batch every `batch_poll_interval_s` (any replica; leases keep
    them from doubling up). Redis outages are waited out."""
    store: BatchStore = app.state.batches
    interval = app.state.settings.batch_poll_interval_s

    def advance_all() -> None:
        for batch_id in store.connection.smembers(ACTIVE_BATCHES_KEY):
            try:
                store.advance(batch_id.decode())
            except Exception as exc:
                if passing_redis_trouble(exc) is not None:
                    raise
                # One batch's fault must not stop the others from advancing.
                log.exception("batch supervisor: advancing batch %s failed; retrying next round", batch_id.decode())

    while True:
        try:
            await anyio.to_thread.run_sync(advance_all, limiter=app.state.blocking)
        except Exception as exc:
            if (trouble := passing_redis_trouble(exc)) is not None:
                log.warning("batch supervisor: Redis %s (%s); retrying", trouble, exc)
            else:
                log.exception("batch supervisor: advancing batches failed; retrying")
        await asyncio.sleep(interval)


# ---- endpoints ----------------------------------------------------------------------------

router = APIRouter(prefix="/v1/batches", tags=["Batch API"])
Auth = Annotated[Caller, Depends(authenticate)]


def _store(request: Request) -> BatchStore:
    return request.app.state.batches


def _found(record: BatchRecord | None, batch_id: str) -> BatchRecord:
    """The record, or 404 (for another tenant's batch too)."""
    if record is None:
        raise ApiError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
    return record


@router.post("")
async def create_batch(
    body: BatchCreate, request: Request, caller: Auth, idempotency_key: Annotated[str | None, Header()] = None,
) -> dict:
    record = await blocking(request, _store(request).create, body, idempotency_key, caller)
    request.app.state.metrics.batches_created.inc()
    return record.public()


@router.get("")
async def list_batches(
    request: Request, caller: Auth, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None,
) -> dict:
    records, has_more = await blocking(request, _store(request).list, limit, after, caller)
    data = [record.public() for record in records]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


@router.get("/{batch_id}")
async def get_batch(batch_id: str, request: Request, caller: Auth) -> dict:
    _found(await blocking(request, _store(request).get, batch_id, caller), batch_id)
    return _found(await blocking(request, _store(request).advance, batch_id), batch_id).public()


@router.post("/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, caller: Auth) -> dict:
    _found(await blocking(request, _store(request).get, batch_id, caller), batch_id)
    return _found(await blocking(request, _store(request).request_cancel, batch_id), batch_id).public()
