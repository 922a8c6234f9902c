"""A batch's life in Redis: created from an uploaded input file, its lines read and their
jobs queued (the fan-out), its progress pulled from the jobs' own states, and, once nothing
is pending, its output and error files written. Refusals are BatchRefused (the routes make
them HTTP errors).

A batch's state lives in Redis only, so any api replica serves it and restarts lose nothing:
- the record (OpenAI's batch object plus how far the input has been read);
- per input line: its custom_id, and, for a line that cannot run, its error-file line;
- per line: its outcome, once seen (finished, failed, canceled);
- for a summary batch, per document: its stage (api/batches/documents.py).

Each valid line of a plain batch becomes an ordinary job, id `<batch id>-<line>`; each
document of a summary batch one job per chunk, then per reduce. They go in the batch queue
at `batch_priority`: workers take them only when no interactive request waits (and never
into the slots reserved for those). Lines are read and their jobs queued a chunk at a time,
each chunk in one transaction with the record's read position, so a fan-out interrupted
anywhere resumes where it stopped and never queues a line twice.

Progress is pulled, not pushed: `advance()` reads the status of the jobs not yet seen to
end and records their outcomes (idempotently, by line), so the counts stay exact whatever
ran a job and however often (a worker killed mid-job, RQ's retries, a plain `rq worker`).
Every api process advances every active batch (api/batches/supervisor.py); a lease per
batch keeps replicas from doing the same work twice, and a GET advances it too. Line jobs
keep their results for the completion window on top of `result_ttl_s`, so results outlive
the batch's window.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from redis import Redis
from rq.job import Job

from api.auth import ANYONE, Caller
from api.batches import lease
from api.batches.documents import DocumentState, LineRefused, SummaryLines
from api.batches.schemas import (
    ACTIVE,
    BATCH_ID_PATTERN,
    COMPLETION_WINDOWS,
    BatchCreate,
    BatchRecord,
    BatchUsage,
    RequestCounts,
    error_line,
    line_job_id,
    response_line,
)
from api.errors import IDEMPOTENCY_CONFLICT_CODE, IDEMPOTENCY_CONFLICT_STATUS, ApiError, openai_error_body
from api.files import FileConflict, FileStore
from api.jobs import JobStore, invalid_input
from api.openai_compat import REQUEST_MODELS, OpenAITranslator
from api.summaries.summarizer import InvalidOptions, Summarizer
from pagedq.protocol import JobPayload
from pagedq.redis_schema import ACTIVE_BATCHES_KEY, BATCHES_KEY, JOB_SERIALIZER, TERMINAL, batch_key, job_state, tenant_batches_key
from pagedq.request_rules import MAX_JSON_DEPTH, json_too_deep, unencodable_text
from pagedq.settings import Settings
from pagedq.summaries import SUMMARIES_ENDPOINT, SummarizeOptions

log = logging.getLogger("pagedq.api")

ENDPOINTS = (*REQUEST_MODELS, SUMMARIES_ENDPOINT)
# Lines per fan-out transaction; a summary batch's lines are documents, each many jobs.
_CHUNK_LINES = 256
_CHUNK_DOCUMENTS = 8


@dataclass
class _Line:
    """One input line as read: its error-file line, or the jobs it queues [(id, payload)]
    (and, in a summary batch, the document's state)."""

    index: int
    custom_id: str | None
    error: str | None = None
    jobs: list[tuple[str, JobPayload]] = field(default_factory=list)
    document: DocumentState | None = None


def _batch_errors(code: str, message: str) -> dict:
    """A batch's `errors` (OpenAI's shape) holding one error about the whole batch."""
    return {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}


class BatchRefused(Exception):
    """A request about batches that cannot be done: an HTTP status, the message (naming the
    field), OpenAI's param and code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class BatchStore:
    def __init__(self, connection: Redis, settings: Settings, jobs: JobStore, files: FileStore, translator: OpenAITranslator):
        self.connection = connection
        self.settings = settings
        self.jobs = jobs
        self.files = files
        self.translator = translator
        self.documents = SummaryLines(connection, jobs, translator.checker, settings, self._enqueue)

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
        if body.endpoint not in ENDPOINTS:
            raise BatchRefused(400, f"endpoint: one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}", param="endpoint")
        if body.completion_window not in COMPLETION_WINDOWS:
            raise BatchRefused(400, f"completion_window: one of {', '.join(COMPLETION_WINDOWS)}, "
                               f"got {body.completion_window!r}", param="completion_window")
        summary = self._summary_options(body)
        stored = self.files.get(body.input_file_id)
        if stored is None or not caller.owns(stored.owner):
            raise BatchRefused(404, f"input_file_id: no file {body.input_file_id!r}", param="input_file_id",
                               code="file_not_found")
        if stored.purpose != "batch":
            raise BatchRefused(400, f"input_file_id: file {body.input_file_id} has purpose {stored.purpose!r}, "
                               "not 'batch'", param="input_file_id")
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
            request_sha256=request_sha256, owner=caller.tenant, summary=summary,
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
                raise BatchRefused(IDEMPOTENCY_CONFLICT_STATUS, "Idempotency-Key: already used for a different batch",
                                   code=IDEMPOTENCY_CONFLICT_CODE)
        # Runs (or resumes) the fan-out now, so the answer says which lines were accepted.
        return self.advance(batch_id, wait_s=30.0) or record

    def _summary_options(self, body: BatchCreate) -> SummarizeOptions | None:
        """A summary batch's options (the defaults where none are given), checked against the
        served model; None for a plain batch."""
        if body.endpoint != SUMMARIES_ENDPOINT:
            if body.summary is not None:
                raise BatchRefused(400, f"summary: only for endpoint {SUMMARIES_ENDPOINT}", param="summary")
            return None
        options = body.summary or SummarizeOptions()
        try:
            self.documents.summarizer(options)
        except InvalidOptions as exc:
            raise BatchRefused(400, str(exc), param=str(exc).split(":")[0]) from None
        return options

    def refused(self, batch_id: str) -> list[dict]:
        """The error-file lines of the input lines refused so far (known before anything runs)."""
        raw = self.connection.hgetall(batch_key(batch_id, "errors"))
        return [json.loads(line) for _, line in sorted((int(index), line) for index, line in raw.items())]

    def request_cancel(self, batch_id: str) -> BatchRecord | None:
        record = self.get(batch_id)
        if record is None:
            return None
        if record.status in ("cancelling", "cancelled"):
            return record
        if record.status not in ACTIVE:
            raise BatchRefused(409, f"batch {batch_id} is {record.status}; nothing to cancel", code="batch_not_active")
        # The flag reaches a replica busy with this batch (it looks between chunks and steps).
        self.connection.set(batch_key(batch_id, "cancel"), "1", ex=self.settings.files_ttl_s)
        with lease.lease(self.connection, batch_id, wait_s=5.0) as held:
            record = self.get(batch_id) or record
            if record.status in ("validating", "in_progress"):
                record.status, record.cancelling_at = "cancelling", int(time.time())
                if held:
                    self._save(record)
                    self.jobs.cancel_many(self._pending_job_ids(record, self._refresh(record)))
                    self._save(record)
        # "cancelled" once an advance has seen every line end (the supervisor's next round, or a GET).
        return record

    # ---- progress -----------------------------------------------------------------------

    def advance(self, batch_id: str, wait_s: float = 0.0) -> BatchRecord | None:
        """Take the batch as far as it can go now; the record as it then is (as stored, when
        another replica holds the batch)."""
        with lease.lease(self.connection, batch_id, wait_s) as held:
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
                    self.jobs.cancel_many(self._pending_job_ids(record, pending))
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
        record.errors = _batch_errors(code, message)

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
        summarizer = self.documents.summarizer(record.summary) if record.summary is not None else None
        chunk_lines = _CHUNK_LINES if summarizer is None else _CHUNK_DOCUMENTS
        chunk: list[_Line] = []
        for index, raw in enumerate(self.files.lines(record.input_file_id)):
            if index < record.lines_read:
                continue
            if raw.strip():
                try:
                    line = self._line(record, summarizer, index, raw, seen)
                except Exception:  # a line's fault, whatever it is, is that line's error alone
                    log.exception("batch %s: line %d could not be read", record.id, index + 1)
                    line = _Line(index, None, error_line(record.id, index, None, "internal_error",
                                                         f"line {index + 1}: could not be read"))
                seen.add(line.custom_id)
                chunk.append(line)
            if len(chunk) >= chunk_lines:
                self._commit(record, chunk, index + 1)
                chunk = []
                if self.connection.exists(batch_key(record.id, "cancel")):
                    record.status, record.cancelling_at = "cancelling", int(time.time())
                    self._save(record)
                    return
        self._commit(record, chunk, record.lines_read if not chunk else chunk[-1].index + 1)
        if self.files.get(record.input_file_id) is None:
            # Deleted while it was read (a file in Redis then reads as ending early): the lines
            # read are not the batch. It is cancelled, saying why, rather than run short.
            record.errors = _batch_errors("file_not_found", f"input file {record.input_file_id} was deleted while "
                                          f"the batch read it ({record.lines_read} lines read); the batch is cancelled")
            record.status, record.cancelling_at = "cancelling", int(time.time())
            return
        record.status, record.in_progress_at = "in_progress", int(time.time())

    def _line(self, record: BatchRecord, summarizer: Summarizer | None, index: int, raw: bytes, seen: set) -> _Line:
        """One input line: its error line, or the jobs it queues (and for a document, its state)."""
        if json_too_deep(raw):
            return _Line(index, None, error_line(record.id, index, None, "invalid_json",
                                                 f"line {index + 1}: nested more than {MAX_JSON_DEPTH} levels deep"))
        try:
            line = json.loads(raw)
        except ValueError as exc:
            return _Line(index, None, error_line(record.id, index, None, "invalid_json", f"line {index + 1}: not JSON ({exc})"))
        if not isinstance(line, dict):
            return _Line(index, None, error_line(record.id, index, None, "invalid_request",
                                                 f"line {index + 1}: not a JSON object"))
        custom_id = line.get("custom_id")
        problem = None
        if not isinstance(custom_id, str) or not custom_id:
            custom_id, problem = None, "custom_id: a non-empty string is required"
        elif (why := unencodable_text(custom_id)) is not None:
            # The output files are UTF-8: a lone surrogate went into them as "\ud800", which strict parsers refuse.
            custom_id, problem = None, f"custom_id: {why}"
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
        if problem is None and summarizer is not None:
            try:
                document, jobs = self.documents.parse(record, summarizer, index, line["body"])
                return _Line(index, custom_id, jobs=jobs, document=document)
            except LineRefused as exc:
                problem = str(exc)
        if problem is not None:
            return _Line(index, custom_id, error_line(record.id, index, custom_id, "invalid_request",
                                                      f"line {index + 1}: {problem}"))
        try:
            body = self.translator.parse(record.endpoint, line["body"])
            if body.stream:
                raise ApiError(400, "stream: not available in a batch", param="stream")
            # The output line is built from the job's result alone, which holds none of these,
            # nor how to parse a model's tool calls.
            for field in ("echo", "return_token_ids", "prompt_logprobs", "tools"):
                if getattr(body, field, None) not in (None, False, []):
                    raise ApiError(400, f"{field}: not available in a batch", param=field)
            prepared = self.translator.prepare(record.endpoint, body)
            if len(prepared) != 1:
                raise ApiError(400, f"prompt: one prompt per batch line, got {len(prepared)}", param="prompt")
            ((request, prompt_token_ids),) = prepared
            request.priority = self.settings.batch_priority
        except ApiError as exc:
            error = openai_error_body(exc.status_code, str(exc.detail), exc.param, exc.code)
            return _Line(index, custom_id, response_line(record.id, index, custom_id, exc.status_code, error))
        # A batch line is never streamed: stream is refused above, so the request's is false.
        return _Line(index, custom_id, jobs=[(line_job_id(record.id, index), JobStore.payload(request, prompt_token_ids))])

    def _enqueue(self, pipeline, record: BatchRecord, job_id: str, payload: JobPayload) -> None:
        # The results must outlive the batch's window (and its finalizing, which reads them).
        result_ttl_s = self.settings.result_ttl_s + COMPLETION_WINDOWS[record.completion_window]
        self.jobs.enqueue_batch_line(pipeline, job_id, payload, result_ttl_s, record.owner)

    def _commit(self, record: BatchRecord, chunk: list[_Line], lines_read: int) -> None:
        record.lines_read = lines_read
        queued = 0
        with self.connection.pipeline() as pipeline:
            pipeline.multi()
            for line in chunk:
                pipeline.hset(batch_key(record.id, "lines"), str(line.index), json.dumps(line.custom_id))
                if line.error is not None:
                    pipeline.hset(batch_key(record.id, "errors"), str(line.index), line.error)
                elif line.document is not None:
                    self.documents.queue(pipeline, record, line.index, line.document, line.jobs)
                else:
                    for job_id, payload in line.jobs:
                        self._enqueue(pipeline, record, job_id, payload)
                queued += len(line.jobs)
            for part in ("lines", "errors", "docs"):
                pipeline.expire(batch_key(record.id, part), self.settings.files_ttl_s)
            self._save(record, pipeline)
            pipeline.execute()
        lease.renew(self.connection, record.id)
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
        if record.summary is not None:
            ended = self.documents.refresh(record, pending, outcomes)
            outcomes.update(ended)
            pending = [index for index in pending if index not in ended]
        elif pending:
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

    def _pending_job_ids(self, record: BatchRecord, pending: list[int]) -> list[str]:
        if record.summary is not None:
            return self.documents.pending_job_ids(record, pending)
        return [line_job_id(record.id, index) for index in pending]

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
            if record.summary is not None:
                output = (response_line(record.id, index, custom_ids.get(index), 200, body)
                          for index, body in self.documents.output(record, finished, record.usage))
            else:
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
            yield from zip(chunk, Job.fetch_many(ids, self.connection, serializer=JOB_SERIALIZER))
            lease.renew(self.connection, record.id)

    def _output_lines(self, record: BatchRecord, finished: list[int], custom_ids: dict, expired: list[int],
                      usage: BatchUsage) -> Iterator[str]:
        """The output file's lines; adds each request's tokens to `usage`."""
        for index, job in self._jobs(record, finished):
            result = self.jobs.job_outcome(job)[1] if job is not None else None
            if result is None:
                expired.append(index)  # for the error file
                continue
            usage.add(result.usage.prompt_tokens, result.usage.completion_tokens)
            logprobs = JobPayload.model_validate(job.kwargs).sampling.logprobs
            body = self.translator.response(record.endpoint, line_job_id(record.id, index), [result], logprobs)
            yield response_line(record.id, index, custom_ids.get(index), 200, body)

    def _error_lines(self, record: BatchRecord, unfinished: list[int], custom_ids: dict, errors: dict,
                     outcomes: dict) -> Iterator[str]:
        for index in unfinished:
            custom_id = custom_ids.get(index)
            if index in errors:
                yield errors[index]
            elif outcomes[index] == "finished":
                yield error_line(record.id, index, custom_id, "result_expired",
                                  "the request finished, but its result expired before the batch was finalized")
            elif outcomes[index] == "canceled":
                code = "batch_expired" if record.expired_at is not None and record.cancelling_at is None else "batch_cancelled"
                yield error_line(record.id, index, custom_id, code, f"the batch was {code.removeprefix('batch_')} "
                                  "before this request ran to the end")
            else:
                message = self._failure(record, index)
                if (invalid := invalid_input(message)) is not None:
                    yield response_line(record.id, index, custom_id, 400,
                                         openai_error_body(400, invalid, code="invalid_request"))
                else:
                    yield response_line(record.id, index, custom_id, 500,
                                         openai_error_body(500, f"the request failed: {message}", code="job_failed"))

    def _failure(self, record: BatchRecord, index: int) -> str:
        """Why a line failed: its job's failure (a document's: the first of its jobs that failed)."""
        if record.summary is not None:
            return self.documents.failure(record, index)
        job = Job.fetch_many([line_job_id(record.id, index)], self.connection, serializer=JOB_SERIALIZER)[0]
        return JobStore.failure_message(job) if job is not None else "the job is gone"
