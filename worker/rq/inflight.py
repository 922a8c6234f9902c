"""What the batch worker keeps about its jobs: one record per job in the engine
(`InFlight`), per job the I/O thread has just marked started (`Started`), and per Redis
round trip on its way (`PendingSync`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

from pagedq.protocol import GenerationResult, JobPayload
from worker.rq.publisher import Sending

if TYPE_CHECKING:
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
