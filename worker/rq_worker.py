"""`pagedq worker`: an RQ worker that runs many jobs at once through one continuous-batching engine.

RQ's own workers run one job per process. `BatchWorker` keeps RQ's bookkeeping (birth
and death, executions, the started registry, success and failure handling with Retry),
so `rq info`, `Job.fetch(id).get_status()` and `return_value()` tell the truth, and
replaces the work loop. One tick:

1. reap: requeue the jobs of workers whose heartbeats stopped (a short TTL, checked often);
2. admit: move up to the free capacity of job ids off the queue in one script call and
   mark them started in one transaction (only while the engine has no backlog, so queued
   jobs stay in Redis for other workers);
3. check: read every in-flight job's status in one round trip; canceled ones are aborted
   in the engine (their KV blocks freed at once), and ones no longer ours (reaped after a
   stall) are dropped so a job never finishes twice;
4. step the engine once and publish deltas/progress for all jobs in one pipeline;
   finished jobs go through RQ's success path;
5. heartbeat all executions in one pipeline.

SIGTERM stops admission and lets in-flight jobs finish for `drain_timeout_s`; what is
left is requeued at the front. A second signal requeues at once.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis.exceptions
from redis import Redis
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.utils import as_text
from rq.worker import BaseWorker, WorkerStatus

from pagedq.protocol import JOB_FUNCTION, GenerationResult, JobPayload
from pagedq.settings import Settings
from worker.publisher import ProgressPublisher, publish_end

if TYPE_CHECKING:
    from pagedq.engine import LLMEngine
    from pagedq.outputs import RequestOutput

# Moves up to ARGV[1] ids from the queue to its intermediate list (RQ's crash-safe
# hand-off) in one round trip.
_TAKE_MANY = """
local taken = {}
for _ = 1, tonumber(ARGV[1]) do
    local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
    if not id then break end
    taken[#taken + 1] = id
end
return taken
"""
# How long an idle worker blocks waiting for a job before its next heartbeat/reap.
_IDLE_BLOCK_S = 1.0


@dataclass
class InFlight:
    job: Job
    execution: Execution
    payload: JobPayload | None = None
    started_at: float = 0.0


class BatchWorker(BaseWorker):
    log_result_lifespan = False

    def __init__(self, engine: LLMEngine, settings: Settings, connection: Redis):
        super().__init__(
            [settings.queue_name],
            connection=connection,
            serializer=JSONSerializer,
            worker_ttl=settings.heartbeat_ttl_s,
            log_job_description=False,  # descriptions hold prompts
        )
        self.engine = engine
        self.settings = settings
        self.queue = self.queues[0]
        self.inflight: dict[str, InFlight] = {}
        self.publisher = ProgressPublisher(settings.stream_ttl_s, settings.progress_interval_s)
        self.capacity = min(settings.max_inflight, settings.max_num_seqs)
        self._take_many = connection.register_script(_TAKE_MANY)
        self._draining = False
        self._drain_deadline = math.inf
        self._suspended = False
        self._next_reap = 0.0
        self._next_heartbeat = 0.0

    # ---- RQ hooks -------------------------------------------------------------------

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self.settings.heartbeat_ttl_s

    def _shutdown(self) -> None:
        # RQ raises StopRequested here when idle; we drain from the loop instead.
        if not self._draining:
            self._draining = True
            self._drain_deadline = time.monotonic() + self.settings.drain_timeout_s
            self.log.info("Worker %s: draining %d in-flight jobs", self.name, len(self.inflight))

    def request_force_stop(self, signum, frame) -> None:
        self.log.warning("Worker %s: second signal, requeueing in-flight jobs now", self.name)
        self._drain_deadline = 0.0

    # ---- the loop -------------------------------------------------------------------

    def work(self, logging_level: str = "INFO") -> None:  # type: ignore[override]
        self.bootstrap(logging_level)
        self._install_signal_handlers()
        try:
            while not (self._draining and (not self.inflight or time.monotonic() >= self._drain_deadline)):
                try:
                    self._tick()
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                    # Redis restarting: in-flight work goes on once it is back; anything
                    # half-written is reconciled by the state check and the reaper.
                    self.log.error("Worker %s: Redis unavailable (%s), retrying", self.name, exc)
                    time.sleep(1.0)
            self._check_job_states()
            self._requeue_inflight()
        finally:
            self.teardown()

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_reap:
            self._reap()
            self._next_reap = now + self.settings.reaper_interval_s
        if not self._draining:
            self._admit()
        if self.inflight:
            self._check_job_states()
        if self.engine.has_unfinished_requests():
            self._step()
        if time.monotonic() >= self._next_heartbeat:
            self._heartbeat()

    def _reap(self) -> None:
        """Requeue (or fail, when out of retries) the jobs of workers that stopped beating."""
        self.queue.started_job_registry.cleanup()
        self._suspended = is_suspended(self.connection)
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()

    # ---- admission ------------------------------------------------------------------

    def _admit(self) -> None:
        free = self.capacity - len(self.inflight)
        if free <= 0 or self._suspended or self.engine.stats().get("num_waiting", 0) > 0:
            return
        ids = [as_text(i) for i in self._take_many(keys=[self.queue.key, self.queue.intermediate_queue_key], args=[free])]
        if not ids and not self.engine.has_unfinished_requests():
            first = self.connection.blmove(self.queue.key, self.queue.intermediate_queue_key, _IDLE_BLOCK_S)
            ids = [as_text(first)] if first is not None else []
        if ids:
            self._start_jobs(ids)

    def _start_jobs(self, ids: list[str]) -> None:
        """Mark the taken jobs started in one transaction, then hand them to the engine."""
        started: list[InFlight] = []
        with self.connection.pipeline() as pipeline:
            while True:
                try:
                    # A cancel landing between our read and write must win, not be overwritten.
                    pipeline.watch(*(Job.key_for(i) for i in ids))
                    jobs = Job.fetch_many(ids, self.connection, serializer=self.serializer)
                    pipeline.multi()
                    started = []
                    for job_id, job in zip(ids, jobs):
                        pipeline.lrem(self.queue.intermediate_queue_key, 1, job_id)
                        if job is None or job.get_status(refresh=False) != JobStatus.QUEUED:
                            continue  # deleted or canceled while in transit
                        execution = Execution.create(job, self.settings.heartbeat_ttl_s, pipeline, worker_name=self.name)
                        job.prepare_for_execution(self.name, pipeline)
                        started.append(InFlight(job=job, execution=execution))
                    self.set_state(WorkerStatus.BUSY, pipeline)
                    pipeline.execute()
                    break
                except redis.exceptions.WatchError:
                    continue
        for entry in started:
            self.executions[entry.execution.id] = entry.execution
            self._hand_to_engine(entry)

    def _hand_to_engine(self, entry: InFlight) -> None:
        job = entry.job
        try:
            if job.func_name != JOB_FUNCTION:
                raise ValueError(f"this worker runs only {JOB_FUNCTION} jobs, not {job.func_name}")
            entry.payload = JobPayload.model_validate(job.kwargs)
            self.engine.add_request(
                job.id,
                {"prompt_token_ids": entry.payload.prompt_token_ids},
                entry.payload.sampling,
                arrival_time=entry.payload.enqueued_at,
                priority=entry.payload.priority,
            )
        except Exception:
            job.retries_left = 0  # bad input fails the same way on every attempt
            self._finalize_failure(job, self.queue, entry.execution, sys.exc_info())
            return
        entry.started_at = time.time()
        self.inflight[job.id] = entry
        with self.connection.pipeline(transaction=False) as pipeline:
            self.publisher.start(pipeline, job, prompt_tokens=len(entry.payload.prompt_token_ids))
            pipeline.execute()

    # ---- in-flight checks -----------------------------------------------------------

    def _check_job_states(self) -> None:
        ids = list(self.inflight)
        if not ids:
            return
        with self.connection.pipeline(transaction=False) as pipeline:
            for job_id in ids:
                pipeline.hmget(Job.key_for(job_id), "status", "worker_name")
            states = pipeline.execute()
        gone = [
            job_id
            for job_id, (status, worker_name) in zip(ids, states)
            if as_text(status) != JobStatus.STARTED or as_text(worker_name) != self.name
        ]
        if not gone:
            return
        # Canceled, deleted, or reaped and requeued after a stall: the job is no longer
        # ours to finish. Aborting frees its KV blocks now.
        self.engine.abort_request(gone)
        with self.connection.pipeline() as pipeline:
            for job_id in gone:
                entry = self.inflight.pop(job_id)
                self.publisher.forget(job_id)
                self.cleanup_execution(entry.job, pipeline, entry.execution)
            pipeline.execute()
        self.log.info("Worker %s: dropped %d canceled or reassigned jobs", self.name, len(gone))
        self._next_heartbeat = 0.0  # publish the freed blocks promptly

    # ---- engine step ----------------------------------------------------------------

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            self._fail_inflight(sys.exc_info())
            return
        finished: list[tuple[InFlight, RequestOutput]] = []
        with self.connection.pipeline(transaction=False) as pipeline:
            for output in outputs:
                entry = self.inflight.get(output.request_id)
                if entry is None:
                    continue  # aborted this tick
                self.publisher.update(pipeline, entry.job, output)
                if output.finished:
                    finished.append((entry, output))
            pipeline.execute()
        for entry, output in finished:
            self._finish(entry, output)

    def _finish(self, entry: InFlight, output: RequestOutput) -> None:
        job = entry.job
        del self.inflight[job.id]
        self.publisher.forget(job.id)
        assert entry.payload is not None
        result = GenerationResult.from_output(output, entry.payload.prompt, entry.payload.enqueued_at, entry.started_at)
        self._finalize_success(job, self.queue, entry.execution, result.model_dump(mode="json"))
        # After RQ has recorded the result, so a client that sees "end" can read it.
        with self.connection.pipeline(transaction=False) as pipeline:
            publish_end(pipeline, job.id, "finished", self.settings.stream_ttl_s, finish_reason=result.finish_reason or "")
            pipeline.execute()

    def _fail_inflight(self, exc_info) -> None:
        """The engine raised mid-step: its state is suspect, so every in-flight job fails
        (RQ requeues those with retries left)."""
        self.log.error("Worker %s: engine step failed", self.name, exc_info=exc_info)
        self.engine.abort_request(list(self.inflight))
        for job_id, entry in list(self.inflight.items()):
            del self.inflight[job_id]
            self.publisher.forget(job_id)
            self._finalize_failure(entry.job, self.queue, entry.execution, exc_info)

    # ---- heartbeats and shutdown ----------------------------------------------------

    def _heartbeat(self) -> None:
        ttl = self.settings.heartbeat_ttl_s
        registry = self.queue.started_job_registry
        with self.connection.pipeline(transaction=False) as pipeline:
            self.heartbeat(ttl, pipeline=pipeline)
            for entry in self.inflight.values():
                entry.execution.heartbeat(registry, ttl, pipeline)
            self.set_state(WorkerStatus.BUSY if self.inflight else WorkerStatus.IDLE, pipeline)
            # Lets /ready and tests see the engine's block accounting.
            pipeline.hset(self.key, "engine_stats", json.dumps(self.engine.stats()))
            pipeline.execute()
        self._next_heartbeat = time.monotonic() + ttl / 3

    def _requeue_inflight(self) -> None:
        if not self.inflight:
            return
        self.log.info("Worker %s: requeueing %d unfinished jobs", self.name, len(self.inflight))
        self.engine.abort_request(list(self.inflight))
        with self.connection.pipeline() as pipeline:
            for entry in self.inflight.values():
                self.cleanup_execution(entry.job, pipeline, entry.execution)
                self.queue.enqueue_job(entry.job, pipeline=pipeline, at_front=True)
            pipeline.execute()
        self.inflight.clear()


def run_worker(settings: Settings) -> None:
    """Entry point of `pagedq worker`."""
    from worker.engine_factory import build_engine

    connection = Redis.from_url(settings.require_redis_url())
    connection.ping()
    BatchWorker(build_engine(settings), settings, connection).work()
