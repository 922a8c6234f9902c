"""The lines of a summary batch (pagedq/summaries.py): each is a document, summarized in
stages, every stage's jobs queued in one transaction with the document's state, and a stage
started only from the recorded results of the one before. So an api that dies anywhere
resumes where the state says, a worker that dies reruns only its unfinished jobs, and no
chunk is ever summarized twice.

Redis (batch_key(id, "docs")): per line index, a DocumentState as JSON."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError
from redis import Redis
from rq.job import Job

from api.batches.schemas import BatchRecord, BatchUsage, stage_job_id
from api.errors import describe_validation_errors
from api.jobs import JobStore
from api.prompts import PromptChecker
from api.summaries.summarizer import Summarizer
from pagedq.protocol import JobPayload
from pagedq.redis_connection import passing_redis_trouble
from pagedq.request_rules import ValidInput
from pagedq.redis_schema import JOB_SERIALIZER, TERMINAL, batch_key, job_state
from pagedq.settings import Settings
from pagedq.summaries import DocumentProgress, StageUsage, SummarizeOptions, SummaryBody

log = logging.getLogger("pagedq.api")
# A batch object lists each document's progress up to this many documents.
MAX_LISTED_DOCUMENTS = 1000
# Queues a job in the caller's transaction: (pipeline, record, job id, payload).
Enqueue = Callable[[object, BatchRecord, str, JobPayload], None]


class DocumentBody(ValidInput):
    """A summary batch line's body (its text valid Unicode: a lone surrogate reached the
    tokenizer, and the line failed as "could not be read", its custom_id lost)."""

    model_config = ConfigDict(extra="forbid")
    text: StrictStr


class DocumentState(BaseModel):
    stage: int = 0
    requests: int
    stages: list[StageUsage] = []  # the stages done
    summary: str | None = None
    error: str | None = None

    @property
    def kind(self) -> str:
        return "map" if self.stage == 0 else "reduce"

    def job_ids(self, batch_id: str, index: int) -> list[str]:
        return [stage_job_id(batch_id, index, self.stage, part) for part in range(self.requests)]


def _stage_jobs(record: BatchRecord, summarizer: Summarizer, index: int, state: DocumentState,
                prompts: list[list[int]]) -> list[tuple[str, JobPayload]]:
    """The jobs of the document's current stage: (job id, payload), one per prompt."""
    return [(job_id, summarizer.payload(ids)) for job_id, ids in zip(state.job_ids(record.id, index), prompts)]


class LineRefused(ValueError):
    """A document line that cannot run; the message names the field."""


class SummaryLines:
    def __init__(self, connection: Redis, jobs: JobStore, checker: PromptChecker, settings: Settings, enqueue: Enqueue):
        self.connection = connection
        self.jobs = jobs
        self.checker = checker
        self.settings = settings
        self.enqueue = enqueue

    def summarizer(self, options: SummarizeOptions) -> Summarizer:
        """InvalidOptions for options the served model cannot run."""
        return Summarizer(self.checker, options, self.settings.batch_priority)

    # ---- fan-out ----------------------------------------------------------------------

    def parse(self, record: BatchRecord, summarizer: Summarizer, index: int, body: dict) -> tuple[DocumentState, list]:
        """The document's state and its map jobs [(job id, payload)]."""
        try:
            text = DocumentBody.model_validate(body).text
        except ValidationError as exc:
            raise LineRefused(describe_validation_errors(exc.errors())) from None
        if not text.strip():
            raise LineRefused("text: the document is empty")
        if len(text) > self.settings.max_document_chars:
            raise LineRefused(f"text: {len(text)} characters, more than a document may have "
                              f"({self.settings.max_document_chars}, PAGEDQ_MAX_DOCUMENT_CHARS)")
        prompts = summarizer.map_prompts(text)
        state = DocumentState(requests=len(prompts))
        return state, _stage_jobs(record, summarizer, index, state, prompts)

    def queue(self, pipeline, record: BatchRecord, index: int, state: DocumentState, jobs: list) -> None:
        """A stage's jobs and the state naming them, in the caller's transaction."""
        for job_id, payload in jobs:
            self.enqueue(pipeline, record, job_id, payload)
        pipeline.hset(batch_key(record.id, "docs"), str(index), state.model_dump_json())

    # ---- progress ---------------------------------------------------------------------

    def states(self, record: BatchRecord) -> dict[int, DocumentState]:
        raw = self.connection.hgetall(batch_key(record.id, "docs"))
        return {int(i): DocumentState.model_validate_json(state) for i, state in raw.items()}

    def pending_job_ids(self, record: BatchRecord, pending: list[int]) -> list[str]:
        states = self.states(record)
        return [job_id for index in pending if index in states for job_id in states[index].job_ids(record.id, index)]

    def refresh(self, record: BatchRecord, pending: list[int], outcomes: dict[int, str]) -> dict[int, str]:
        """Move each pending document on as far as its jobs allow: a stage whose jobs all
        finished starts the next (or ends the document); the outcomes of the documents that
        ended. Sets the record's per-document progress."""
        states = self.states(record)
        pending = [index for index in pending if index in states]
        ids = {index: states[index].job_ids(record.id, index) for index in pending}
        with self.connection.pipeline(transaction=False) as pipeline:
            for index in pending:
                for job_id in ids[index]:
                    pipeline.hget(Job.key_for(job_id), "status")
            statuses = iter(pipeline.execute())
        done: dict[int, int] = {}
        ended: dict[int, str] = {}
        summarizer = None
        for index in pending:
            parts = [job_state(next(statuses)) or "failed" for _ in ids[index]]  # None: the job is gone
            done[index] = parts.count("finished")
            if not TERMINAL.issuperset(parts):
                continue
            summarizer = summarizer or self.summarizer(record.summary)
            try:
                outcome = self._stage_ended(record, summarizer, index, states[index], parts)
            except Exception as exc:
                if passing_redis_trouble(exc) is not None:
                    raise  # the supervisor waits it out
                # One document's fault is its own: the others move on.
                log.exception("batch %s: document %d could not move on", record.id, index + 1)
                states[index].error = f"its next stage could not be made ({type(exc).__name__}: {exc})"
                outcome = self._end(record, index, states[index], "failed")
            if outcome is not None:
                ended[index] = outcome
            done[index] = 0 if outcome is None else done[index]
        custom_ids = {int(i): json.loads(c) for i, c in self.connection.hgetall(batch_key(record.id, "lines")).items()}
        if len(custom_ids) <= MAX_LISTED_DOCUMENTS:
            status = {"finished": "completed", "failed": "failed", "canceled": "cancelled"}
            record.documents = [
                DocumentProgress(
                    custom_id=custom_ids.get(index), stage=state.stage, kind=state.kind, requests=state.requests,
                    status=status.get(ended.get(index) or outcomes.get(index), "in_progress"),
                    done=done.get(index, state.requests if index in outcomes or index in ended else 0))
                for index, state in sorted(states.items())  # as the stages just queued left them
            ]
        return ended

    def _stage_ended(self, record: BatchRecord, summarizer: Summarizer, index: int, state: DocumentState,
                     parts: list[str]) -> str | None:
        """The document's outcome, or None when its next stage was queued."""
        job_ids = state.job_ids(record.id, index)
        if "failed" in parts:
            job = Job.fetch_many([job_ids[parts.index("failed")]], self.connection, serializer=JOB_SERIALIZER)[0]
            state.error = JobStore.failure_message(job) if job is not None else "the job is gone"
            return self._end(record, index, state, "failed")
        if "canceled" in parts or record.status != "in_progress":
            return self._end(record, index, state, "canceled")
        results = [self.jobs.job_outcome(job)[1] if job is not None else None
                   for job in Job.fetch_many(job_ids, self.connection, serializer=JOB_SERIALIZER)]
        if None in results:
            state.error = "a partial summary's result expired before the next stage read it"
            return self._end(record, index, state, "failed")
        state.stages.append(StageUsage(
            stage=state.stage, kind=state.kind, requests=state.requests,
            prompt_tokens=sum(r.usage.prompt_tokens for r in results),
            completion_tokens=sum(r.usage.completion_tokens for r in results)))
        if state.requests == 1:
            state.summary = results[0].text
            return self._end(record, index, state, "finished")
        prompts = summarizer.reduce_prompts([r.text for r in results])
        state.stage, state.requests = state.stage + 1, len(prompts)
        jobs = _stage_jobs(record, summarizer, index, state, prompts)
        with self.connection.pipeline() as pipeline:
            pipeline.multi()
            self.queue(pipeline, record, index, state, jobs)
            pipeline.execute()
        self.jobs.on_enqueued(self.jobs.batch_queue.name, len(jobs))
        return None

    def _end(self, record: BatchRecord, index: int, state: DocumentState, outcome: str) -> str:
        # The state with its summary or error, and the outcome, together (the store records
        # the outcome again with the others: the same value).
        with self.connection.pipeline() as pipeline:
            pipeline.multi()
            pipeline.hset(batch_key(record.id, "docs"), str(index), state.model_dump_json())
            pipeline.hset(batch_key(record.id, "outcomes"), str(index), outcome)
            pipeline.expire(batch_key(record.id, "outcomes"), self.settings.files_ttl_s)
            pipeline.execute()
        return outcome

    # ---- results ----------------------------------------------------------------------

    def output(self, record: BatchRecord, finished: list[int], usage: BatchUsage) -> Iterator[tuple[int, dict]]:
        """(index, output body) of each finished document; adds their tokens to `usage`."""
        states = self.states(record)
        for index in finished:
            state = states[index]
            prompt_tokens = sum(stage.prompt_tokens for stage in state.stages)
            completion_tokens = sum(stage.completion_tokens for stage in state.stages)
            usage.add(prompt_tokens, completion_tokens)
            yield index, SummaryBody(summary=state.summary or "", stages=state.stages, usage={
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}).model_dump()

    def failure(self, record: BatchRecord, index: int) -> str:
        raw = self.connection.hget(batch_key(record.id, "docs"), str(index))
        return (DocumentState.model_validate_json(raw).error if raw else None) or "the document's state is gone"

