"""What the batch worker keeps about its jobs: one record per job in the engine
(`InFlight`), gathered in `InFlightJobs` with what their outputs say; per job the I/O
thread has just marked started (`Started`); and per Redis round trip on its way
(`PendingSync`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

from pagedq.protocol import GenerationResult, JobPayload
from worker.rq.publisher import ProgressPublisher, Sending

if TYPE_CHECKING:
    from pagedq.front.llm_engine import LLMEngine
    from pagedq.metrics import WorkerMetrics
    from pagedq.outputs import RequestOutput


@dataclass
class InFlight:
    job: Job
    queue: Queue
    execution: Execution
    payload: JobPayload
    started_at: float
    # The engine's final output and the result made of it, kept until RQ has recorded the result.
    final: RequestOutput | None = None
    result: GenerationResult | None = None
    # Why the request failed alone (its result is then never built).
    error: str | None = None
    # For the inter-token latency: tokens seen so far, and when the last one came.
    num_tokens: int = 0
    last_token_at: float = 0.0

    @property
    def request_id(self) -> str:
        return self.execution.id


class InFlightJobs:
    """The jobs in this worker's engine, by engine request id (= execution id, so a job that
    comes back to this worker after a requeue is never confused with its earlier run), and
    what their outputs say: each output goes to the publisher, and to the inter-token
    latency metric; a finished one is kept (`final`) until RQ has recorded its result."""

    def __init__(self, engine: LLMEngine, publisher: ProgressPublisher, metrics: WorkerMetrics, log: logging.Logger):
        self._engine = engine
        self._publisher = publisher
        self._metrics = metrics
        self._log = log
        self._entries: dict[str, InFlight] = {}
        # The one run of each job here (by job id): a job this worker runs again is taken
        # again only once its earlier run is dropped (of_job()), so the publisher, which
        # follows a job's stream by job id, follows one run.
        self._runs: dict[str, InFlight] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[InFlight]:
        # A copy: callers end jobs as they go.
        return iter(list(self._entries.values()))

    def __contains__(self, entry: InFlight) -> bool:
        return entry.request_id in self._entries

    def get(self, request_id: str) -> InFlight | None:
        return self._entries.get(request_id)

    def of_job(self, job_id: str) -> InFlight | None:
        """The job's run in flight here, if any."""
        return self._runs.get(job_id)

    def add(self, entry: InFlight) -> None:
        """A job the engine has just been given (its earlier run here, if any, dropped first)."""
        assert entry.job.id not in self._runs, f"{entry.job.id} is in flight here already"
        self._entries[entry.request_id] = entry
        self._runs[entry.job.id] = entry
        self._publisher.track(entry.job, stream=entry.payload.stream, fence=entry.execution.composite_key)

    def remove(self, entry: InFlight) -> None:
        """A job done with here whose request the engine has finished (or never had)."""
        del self._entries[entry.request_id]
        del self._runs[entry.job.id]
        self._publisher.forget(entry.job.id)

    def abort(self, entries: list[InFlight]) -> None:
        """Jobs done with here whose requests the engine may still run: aborted, which frees their KV blocks."""
        self._engine.abort_request([entry.request_id for entry in entries])
        for entry in entries:
            self.remove(entry)

    def running(self) -> list[InFlight]:
        return [entry for entry in self._entries.values() if entry.final is None]

    def finishing(self) -> list[InFlight]:
        """Finished in the engine, their results not yet recorded."""
        return [entry for entry in self._entries.values() if entry.final is not None]

    def delta_due(self, request_id: str) -> bool:
        """Whether the publisher would send the request's next delta now (else its output need not be built)."""
        entry = self._entries.get(request_id)
        return entry is None or self._publisher.due(entry.job.id)

    def take_outputs(self, outputs: list[RequestOutput]) -> None:
        """Record outputs for the publisher and the metrics; a finished one ends its request.
        A job's tokens since its last output (or since its first token) are taken to have
        come evenly: one inter-token latency per gap, summing to the time that passed."""
        now = time.time()
        for output in outputs:
            entry = self._entries.get(output.request_id)
            if entry is None:
                continue  # dropped before this step
            self._publisher.update(entry.job.id, output)
            num_tokens = len(output.outputs[0].token_ids)
            if num_tokens > entry.num_tokens:
                since, counted = entry.last_token_at, entry.num_tokens
                if not counted:
                    since, counted = output.metrics.first_token_time or now, 1
                if num_tokens > counted:
                    latency = max(now - since, 0.0) / (num_tokens - counted)
                    self._metrics.inter_token_latency.observe(latency, num_tokens - counted)
                entry.num_tokens, entry.last_token_at = num_tokens, now
            if output.finished:
                entry.final = output

    def failed_alone(self) -> list[InFlight]:
        """Finished requests that the engine failed alone (final.error), or whose result
        cannot be built (kept in `error`): each result is built once, here."""
        failed = []
        for entry in self.finishing():
            if entry.result is None and entry.error is None:
                entry.error = entry.final.error
                if entry.error is None:
                    try:
                        entry.result = GenerationResult.from_output(entry.final, entry.job.id, entry.payload,
                                                                    entry.started_at)
                    except Exception as exc:  # this job's output alone: the others are recorded
                        self._log.exception("the result of %s could not be built", entry.job.id)
                        entry.error = f"its result could not be recorded: {exc!r}"
            if entry.result is None:
                failed.append(entry)
        return failed


@dataclass
class Started:
    """A job the I/O thread marked started, for the engine thread to hand to the engine."""

    job: Job
    execution: Execution
    payload: JobPayload | None = None
    # Its payload could not be read: the job fails (never retried).
    error: tuple | None = None


@dataclass
class PendingSync:
    """One round trip on its way: what it carries, and its future (replies, jobs started)."""

    checked: list[InFlight]
    full: bool
    sending: Sending = field(default_factory=Sending)
    finishing: list[InFlight] = field(default_factory=list)
    future: Future | None = None
