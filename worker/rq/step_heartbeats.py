"""Heartbeats while one engine step runs (or one request's hand-over to the engine: its input
processing). The worker loop beats between steps, and one step can take longer than the
heartbeat TTL (a 2048-token prefill chunk over a long context on a CPU core): its jobs would
be reaped as a dead worker's, rerun, reaped again, and fail.

A thread beats every third of the TTL while a step has been running that long: only while
a step is in progress (the loop clears the mark under the lock the beat holds, so a beat
never overlaps the loop's own bookkeeping), and for at most `max_step_s` of one step, so
an engine that hangs stops beating and its jobs are rerun elsewhere, as a dead worker's."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class StepHeartbeats:
    def __init__(self, beat: Callable[[], None], interval_s: float, max_step_s: float, log: logging.Logger):
        self._beat = beat
        self._interval_s = interval_s
        self._max_step_s = max_step_s
        self._log = log
        self._lock = threading.Lock()
        self._step_started: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-heartbeats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(10)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one engine step or hand-over to the engine (and nothing that changes the
        worker's jobs: the beat reads them)."""
        self._step_started = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._step_started = None

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            with self._lock:
                started = self._step_started
                running_s = time.monotonic() - started if started is not None else 0.0
                # A short step: the loop beats between steps. A hung one: let the jobs go.
                if not self._interval_s <= running_s <= self._max_step_s:
                    continue
                try:
                    self._beat()
                except Exception as exc:  # Redis away: the loop retries once the step ends
                    self._log.warning("heartbeat during a %.0f s engine step failed: %s", running_s, exc)
