"""The batch worker's heartbeats: its own key and state, every in-flight execution's, and
the engine's block accounting, in one pipeline, every third of the heartbeat TTL from the
loop, and from a thread while one engine step runs longer than that (step_heartbeats.py)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from redis.client import Pipeline
from rq import worker_registration
from rq.worker import BaseWorker

from worker.rq.inflight import InFlightJobs
from worker.rq.step_heartbeats import StepHeartbeats

if TYPE_CHECKING:
    from pagedq.front.llm_engine import LLMEngine
    from pagedq.metrics import WorkerMetrics

# One engine step longer than this is taken for a hung engine: its heartbeats stop.
_MAX_STEP_S = 600.0


class Heartbeats:
    def __init__(self, worker: BaseWorker, inflight: InFlightJobs, engine: LLMEngine, metrics: WorkerMetrics,
                 ttl_s: int, state: Callable[[], str], log: logging.Logger):
        self._worker = worker
        self._inflight = inflight
        self._engine = engine
        self._metrics = metrics
        self._ttl_s = ttl_s
        # The worker's state (RQ's WorkerStatus) to show with each beat.
        self._state = state
        self._next = 0.0
        self._during_steps = StepHeartbeats(lambda: self.beat(engine_stats=False), ttl_s / 3, _MAX_STEP_S, log)

    def start(self) -> None:
        self._during_steps.start()

    def stop(self) -> None:
        self._during_steps.stop()

    def step(self) -> AbstractContextManager[None]:
        """Around one engine step, or one request's hand-over to the engine (its input
        processing): beats from a thread if it runs long."""
        return self._during_steps.step()

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def beat_next(self) -> None:
        """Beat at the next tick (a new state to show, or Redis back after an outage)."""
        self._next = 0.0

    def beat(self, engine_stats: bool = True) -> None:
        """`engine_stats` False: from the step heartbeats' thread, while the engine computes."""
        worker, ttl = self._worker, self._ttl_s
        with worker.connection.pipeline(transaction=False) as pipeline:
            worker.heartbeat(ttl, pipeline=pipeline)
            for entry in self._inflight:
                entry.execution.heartbeat(entry.queue.started_job_registry, ttl, pipeline)
            worker.set_state(self._state(), pipeline)
            if engine_stats:
                self.queue_engine_stats(pipeline)
            created = pipeline.execute()[0]
            if created:
                # Our hash expired while Redis was away (or was lost with it): without its
                # other fields and registration, nobody would count this worker.
                pipeline.hset(worker.key, mapping=worker.serialize())
                worker_registration.register(worker, pipeline)
                pipeline.expire(worker.key, ttl)
                pipeline.execute()
        self._next = time.monotonic() + ttl / 3

    def queue_engine_stats(self, pipeline: Pipeline) -> None:
        """The engine's block accounting in the worker's hash, for /ready (and tests).
        Sent with every step's round trip, so it is at most one step old; the metrics read it too."""
        self._metrics.observe_step(self._engine.stats())
        pipeline.hset(self._worker.key, "engine_stats", json.dumps(self._metrics.engine_stats))
