"""What the soak's clients saw, kept for the invariant checks: every response's status,
every job the api accepted (by the Idempotency-Key it was sent with), the text each
client received for it, the cancels the api confirmed, and the violations found on the
way. Shared by the load threads and the fault injector, so every method takes a lock."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

# Statuses a client is told to wait out: Redis unreachable (503), a completion that took
# too long (504), a full queue (429). Any other 5xx is a violation.
RETRYABLE_STATUSES = frozenset({429, 503, 504})
# Path segments that name a job, file or batch (long, with a digit) are counted as one route.
_ID_SEGMENT = re.compile(r"/(?=[^/]*\d)[^/]{16,}")


def route_of(path: str) -> str:
    """`/result/idem-3fa9...` -> `/result/{id}`: counts per route, not per job."""
    return _ID_SEGMENT.sub("/{id}", path.split("?", 1)[0])


@dataclass
class Violation:
    kind: str
    detail: str
    # Seconds since the soak started; None for what the checks after the soak find.
    at_s: float | None = None


@dataclass
class AcceptedJob:
    seq_id: str
    # The scenario that made it (generate-poll, chat-stream, batch, ...).
    scenario: str
    # The text each way of reading it delivered (stream, chat, batch-output, ...), when it ended finished.
    texts: dict[str, str] = field(default_factory=dict)
    # DELETE /result answered "canceled": it must stay canceled.
    cancel_confirmed: bool = False


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.started_at = time.strftime("%Y-%m-%d %H:%M:%S")
        self.statuses: Counter[str] = Counter()
        self.routes: Counter[str] = Counter()
        self.transport_errors: Counter[str] = Counter()
        self.scenarios: Counter[str] = Counter()
        self.violations: list[Violation] = []
        self.jobs: dict[str, AcceptedJob] = {}
        # Idempotency-Key -> every seq_id a 202 answered it with (exactly one is right).
        self.seq_ids_by_key: dict[str, set[str]] = {}

    def elapsed_s(self) -> float:
        return round(time.monotonic() - self._started, 1)

    def response(self, method: str, path: str, status: int, body: str = "") -> None:
        """Every HTTP answer; a 5xx other than the retryable ones is a violation (`body`: its start)."""
        route = f"{method} {route_of(path)}"
        with self._lock:
            self.statuses[str(status)] += 1
            self.routes[f"{route} {status}"] += 1
        if status >= 500 and status not in RETRYABLE_STATUSES:
            self.violation("server-error", f"{route} answered {status}: {body[:300]}")

    def transport_error(self, method: str, path: str, exc: Exception) -> None:
        with self._lock:
            self.transport_errors[f"{method} {route_of(path)}: {type(exc).__name__}"] += 1

    def violation(self, kind: str, detail: str, at_s: float | None = None) -> None:
        """`at_s`: when it happened, if not now."""
        with self._lock:
            self.violations.append(Violation(kind, detail, self.elapsed_s() if at_s is None else at_s))

    def scenario_ran(self, name: str) -> None:
        with self._lock:
            self.scenarios[name] += 1

    def accepted(self, seq_id: str, scenario: str, idempotency_key: str | None = None) -> None:
        with self._lock:
            self.jobs.setdefault(seq_id, AcceptedJob(seq_id, scenario))
            if idempotency_key is not None:
                self.seq_ids_by_key.setdefault(idempotency_key, set()).add(seq_id)

    def received_text(self, seq_id: str, channel: str, text: str) -> None:
        with self._lock:
            job = self.jobs.get(seq_id)
            if job is not None:
                job.texts[channel] = text
                return
        self.violation("unknown-job", f"{channel} delivered text for {seq_id}, which no accepted request made")

    def cancel_confirmed(self, seq_id: str) -> None:
        with self._lock:
            self.jobs[seq_id].cancel_confirmed = True
