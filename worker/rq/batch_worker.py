"""`pagedq worker`: an RQ worker that runs many jobs at once through one continuous-batching engine.

RQ's own workers run one job per process. `BatchWorker` keeps RQ's bookkeeping (birth
and death, executions, the started registry, success and failure handling with Retry),
so `rq info`, `Job.fetch(id).get_status()` and `return_value()` tell the truth, and
replaces the work loop. One tick:

1. reap, when due: requeue the jobs of workers whose heartbeats stopped (a short TTL,
   checked often) and the ids a dead worker took from a queue but never started
   (worker/rq/reaper.py), and read the suspension flag;
2. heartbeat, when due: the worker and every execution (worker/rq/heartbeats.py);
3. send the round trip of what the previous steps produced (worker/rq/round_trip.py) on
   its I/O thread: every job's new text to its stream, the results of the jobs the engine
   finished (RQ's success writes) with their streams' "end", the engine stats, and
   SYNC_SCRIPT: the api's cancel counter, which in-flight jobs are no longer ours, and up
   to the free capacity of new job ids (taken only while the engine has no backlog, so
   queued jobs stay in Redis for other workers): from the interactive queue first, then
   from the batch queue (redis_schema.batch_queue_name), whose jobs never fill the slots
   reserved for interactive ones (`reserved_interactive_slots`). The I/O thread then marks
   the new jobs started (worker/rq/job_starts.py);
4. step the engine once, while that round trip runs: the engine never waits for Redis.
   If the round trip is still out after the step (Redis, the api and the clients share
   the machine's cores), the next tick steps again without sending: what the steps
   produce meanwhile goes in the next round trip, each job's text since its last send as
   one delta, so a Redis that falls behind gets fewer, larger writes instead of a queue;
5. act on the round trip's answer: jobs no longer ours (canceled, deleted, reaped after a
   stall) are aborted in the engine, which frees their KV blocks; a job named by RQ's
   stop-job command fails as STOPPED; finished jobs are forgotten; the started ones go to
   the engine (or, idle, block on the queue for a second). The engine waits for a round
   trip only when it has nothing to compute, and then only until its first chunk of new
   jobs is started.

What the worker keeps per job is in worker/rq/inflight.py; how each job's ending is
written (RQ's success, failure and requeue writes) in worker/rq/outcomes.py.

Every write for a job is fenced: it happens only if the job's execution still owns it,
checked in the same script (redis_schema's owns()), so a worker that stalled past its
heartbeat TTL, and whose jobs were rerun elsewhere, writes nothing for them when it wakes.

Metrics (pagedq.metrics, on `metrics_port`) cost the loop a few additions per output.

Redis going away: every Redis error is retried a second later, forever; the engine pauses
(a tick fails when its round trip does) and what was not yet published or finished is kept
and sent once Redis answers. Heartbeats go first after an outage, so a short one does not get
this worker's jobs reaped; after a long one they are requeued and run again, once.

SIGTERM stops admission and lets in-flight jobs finish for `drain_timeout_s`; what is
left is requeued at the front. A second signal requeues at once.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING

import redis.exceptions
from redis import Redis
from rq.command import parse_payload
from rq.job import Job
from rq.queue import Queue
from rq.suspension import is_suspended
from rq.utils import as_text
from rq.utils import now as utcnow
from rq.worker import BaseWorker, WorkerStatus

from pagedq.front.core_client import EngineDeadError
from pagedq.gc_tuning import freeze_startup_heap
from pagedq.metrics import WorkerMetrics
from pagedq.redis_connection import connect, passing_redis_trouble
from pagedq.redis_schema import (
    JOB_SERIALIZER,
    FencedWrite,
    batch_queue_name,
    expire_canceled,
    queue_fenced_commands,
    request_failure,
)
from pagedq.settings import Settings
from worker.rq import outcomes
from worker.rq.heartbeats import Heartbeats
from worker.rq.inflight import InFlight, InFlightJobs, PendingSync, Started
from worker.rq.job_starts import start_jobs
from worker.rq.publisher import ProgressPublisher
from worker.rq.reaper import Reaper
from worker.rq.round_trip import RoundTrips

if TYPE_CHECKING:
    from pagedq.front.llm_engine import LLMEngine

# How long an idle worker waits for a job (or sleeps while suspended) before its next tick.
_IDLE_WAIT_S = 1.0
# Pause after a Redis error before the next try.
_REDIS_RETRY_S = 1.0
# The longest wait of RQ's pubsub thread (stop-job commands) between looks at whether it
# should stop. RQ waits 60 s; redis-py 8.2's PubSubWorkerThread.stop() joins the thread, and
# one that has read its unsubscribe reply before the stop waits that long for a subscription.
_PUBSUB_POLL_S = 1.0


class JobStopped(Exception):
    """The job was stopped with RQ's stop-job command."""


class BatchWorker(BaseWorker):
    log_result_lifespan = False

    def __init__(self, engine: LLMEngine, settings: Settings, connection: Redis):
        super().__init__(
            [settings.queue_name, batch_queue_name(settings.queue_name)],  # in order of preference
            connection=connection,
            serializer=JOB_SERIALIZER,
            worker_ttl=settings.heartbeat_ttl_s,
            log_job_description=False,  # descriptions hold prompts
        )
        self.engine = engine
        self.settings = settings
        self.queue, self.batch_queue = self.queues
        self._queues_by_name = {queue.name: queue for queue in self.queues}
        self.publisher = ProgressPublisher(connection, settings.stream_ttl_s, settings.progress_interval_s, settings.stream_interval_s)
        self.capacity = min(settings.max_inflight, settings.max_num_seqs)
        self.batch_capacity = max(1, self.capacity - settings.reserved_interactive_slots)
        self.metrics = WorkerMetrics(
            [queue.name for queue in self.queues], settings.model_id, engine.max_model_len, _cache_config(engine),
            settings.metrics_prefix,
        )
        self.metrics_port: int | None = None
        self.inflight = InFlightJobs(engine, self.publisher, self.metrics, self.log)
        self.reaper = Reaper(connection, self.queues, self.serializer, settings.heartbeat_ttl_s, self.log, self.name)
        self.heartbeats = Heartbeats(self, self.inflight, engine, self.metrics, settings.heartbeat_ttl_s, self._state_to_show, self.log)
        self.round_trips = RoundTrips(self, self.inflight, self.publisher, heartbeat_ttl_s=settings.heartbeat_ttl_s,
                                      stream_ttl_s=settings.stream_ttl_s, full_check_interval_s=settings.reaper_interval_s,
                                      queue_engine_stats=self.heartbeats.queue_engine_stats, start_jobs=self._start_jobs)
        # Job ids named by stop-job commands; filled by RQ's pubsub thread.
        self._stop_requests: set[str] = set()
        # Jobs whose failure also ends their stream ("end", failed), in the same fenced write.
        self._end_streams_on_failure: set[str] = set()
        self._draining = False
        self._drain_deadline = math.inf
        self._suspended = False
        self._next_reap = 0.0
        self._engine_dead: EngineDeadError | None = None  # set when a step finds the engine gone
        # The round trip on the I/O thread, until its answer is taken (one at a time).
        self._pending: PendingSync | None = None

    # ---- RQ hooks -------------------------------------------------------------------

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self.settings.heartbeat_ttl_s

    def serialize(self) -> dict:
        # In the worker's hash, so GET /ready can say where to scrape an ephemeral port,
        # and on how many ranks (devices) this worker's engine runs.
        fields = super().serialize()
        if self.metrics_port is not None:
            fields["metrics_port"] = self.metrics_port
        fields["tensor_parallel_size"] = self.engine.args.tensor_parallel_size
        return fields

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        # RQ writes the job's heartbeat here, outside any fence: it is written with the
        # rest of the failure instead (handle_job_failure), the one path that gets here.
        job.ended_at = utcnow()

    def handle_job_failure(self, job: Job, queue: Queue, started_job_registry=None, exc_string="", execution=None):
        """Every failure path of this worker ends here: RQ's failure writes, fenced
        (worker/rq/outcomes.py), so a job that was reaped and rerun elsewhere while it
        failed here is left to its new run, never failed or requeued a second time."""
        stopped = self._stopped_job_id == job.id
        retry = job.should_retry and not stopped
        if stopped:
            self._stopped_job_id = None
        end_stream = job.id in self._end_streams_on_failure
        self._end_streams_on_failure.discard(job.id)
        write = outcomes.failure(self, job, queue, execution, exc_string, stopped=stopped, retry=retry,
                                 end_stream=end_stream, heartbeat_ttl_s=self.settings.heartbeat_ttl_s,
                                 stream_ttl_s=self.settings.stream_ttl_s)
        if self._write_fenced([write]):
            self.log.info("Worker %s: job %s failed here but is no longer ours: failure not recorded", self.name, job.id)
        elif retry:
            self.metrics.jobs_requeued += 1
        else:
            self.metrics.jobs_failed += 1

    def _shutdown(self) -> None:
        # RQ raises StopRequested here when idle; we drain from the loop instead.
        if not self._draining:
            self._draining = True
            self._drain_deadline = time.monotonic() + self.settings.drain_timeout_s
            self.log.info("Worker %s: draining %d in-flight jobs", self.name, len(self.inflight))

    def request_force_stop(self, signum, frame) -> None:
        self.log.warning("Worker %s: second signal, requeueing in-flight jobs now", self.name)
        self._drain_deadline = 0.0

    def subscribe(self) -> None:
        # RQ's own, with a shorter wait: a worker leaving (a drain, a dead engine) waited up to
        # RQ's 60 s in teardown for this thread (see _PUBSUB_POLL_S).
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=_PUBSUB_POLL_S, daemon=True, exception_handler=self._pubsub_exception_handler)

    def handle_payload(self, message) -> None:
        # RQ routes stop-job only to a worker's single "current" job; we hold many.
        payload = parse_payload(message)
        if payload.get("command") == "stop-job":
            self._stop_requests.add(payload.get("job_id", ""))
        else:
            super().handle_payload(message)

    def request_stop_execution(self, execution_id: str) -> None:
        entry = self.inflight.get(execution_id)
        if entry is not None:
            self._stop_requests.add(entry.job.id)

    # ---- the loop -------------------------------------------------------------------

    def work(self, logging_level: str = "INFO") -> None:  # type: ignore[override]
        if self.settings.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.settings.host, self.settings.metrics_port)
        self.bootstrap(logging_level)
        self._install_signal_handlers()
        self.heartbeats.start()
        try:
            while not (self._draining and (not self.inflight or time.monotonic() >= self._drain_deadline)):
                try:
                    self._tick()
                except redis.exceptions.RedisError as exc:
                    trouble = passing_redis_trouble(exc)
                    if trouble is None:
                        raise
                    # Unreachable, out of memory, read-only after a failover, loading...: the
                    # jobs stay ours and the engine waits; what was not written goes later.
                    self.log.error("Worker %s: Redis %s (%s); retrying", self.name, trouble, exc)
                    # Heartbeats first once it is back, then a look at every job.
                    self.heartbeats.beat_next()
                    self.round_trips.check_all_next()
                    time.sleep(_REDIS_RETRY_S)
            if self._pending is not None:
                self._take_pending()
            self._complete_sync(self._send_sync(admit=False, full=True))
            self._requeue_inflight()
            if self._engine_dead is not None:
                raise self._engine_dead
        finally:
            self.heartbeats.stop()
            self.round_trips.shutdown()
            self.teardown()

    def _tick(self) -> None:
        if time.monotonic() >= self._next_reap:
            self._reap()
        if self.heartbeats.due():
            self.heartbeats.beat()
        # The round trip of what earlier steps produced (deltas, finished jobs' results,
        # checks, new jobs started) runs on the I/O thread while the engine computes.
        if self._pending is None:
            self._pending = self._send_sync()
        if self.engine.has_unfinished_requests():
            self._step()
            if not self._pending.future.done():
                # Redis is behind the engine: step on; the next round trip carries this
                # step's output. The jobs it took that are started already go to the engine now.
                if not self._draining:
                    self._hand_all(self.round_trips.take_started())
                return
        elif not self._draining and self._hand_all(self.round_trips.first_started()):
            # Idle, and the round trip took jobs: the engine starts on the first chunk while the
            # I/O thread starts the rest, which go to the engine between its steps (above).
            return
        started = self._take_pending()
        if not started and not self.engine.has_unfinished_requests() and not self.inflight.finishing():
            self._wait_for_work()

    def _state_to_show(self) -> str:
        return WorkerStatus.SUSPENDED if self._suspended else WorkerStatus.BUSY if self.inflight else WorkerStatus.IDLE

    def _reap(self) -> None:
        """Requeue what dead workers left (worker/rq/reaper.py), read the suspension flag,
        and run RQ's maintenance when due."""
        self.metrics.jobs_requeued += self.reaper.reap()
        suspended = bool(is_suspended(self.connection))
        if suspended != self._suspended:
            self._suspended = suspended
            self.heartbeats.beat_next()  # show the new state now
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()
        self._next_reap = time.monotonic() + self.settings.reaper_interval_s

    # ---- the round trip: sending it and acting on its answer ------------------------

    def _send_sync(self, admit: bool = True, full: bool = False) -> PendingSync:
        """Build what the step produced and send the round trip (worker/rq/round_trip.py),
        taking new jobs while admitting: up to the capacity left, and none while the engine
        has a backlog, so queued jobs stay in Redis for other workers."""
        # Only the outputs the publisher sends now are built (text decoded): a job nobody
        # streams sends a delta every progress_interval_s, not every round trip.
        self.inflight.take_outputs(self.engine.deferred_outputs(self.inflight.delta_due))
        self._fail_alone(self.inflight.failed_alone())
        take = batch_take = 0
        if admit and not self._draining and not self._suspended and self.engine.stats()["num_waiting"] == 0:
            # Jobs the engine has finished are recorded in this round trip: their slots are free already.
            running = self.inflight.running()
            take = max(0, self.capacity - len(running))
            batch_take = max(0, self.batch_capacity - sum(entry.queue is self.batch_queue for entry in running))
        return self.round_trips.send(take, batch_take, full)

    def _take_pending(self) -> bool:
        """Wait for the round trip out and act on its answer."""
        pending, self._pending = self._pending, None
        return self._complete_sync(pending)

    def _complete_sync(self, pending: PendingSync) -> bool:
        """Wait for the round trip and act on what it says; True if jobs were started."""
        completed = self.round_trips.wait(pending)
        replies = completed.replies
        if pending.finishing and not isinstance(replies.successes, Exception):
            # (Refused: the jobs keep their final output and are recorded by a later round trip.)
            self._record_successes(pending.finishing, replies.successes)
        if isinstance(replies.sync, Exception):
            # Nothing learned of cancels or new jobs this time: the next round trip asks again.
            raise replies.refusal()
        self.metrics.queue_depth = {queue.name: depth for queue, depth in zip(self.queues, replies.sync.depths)}
        lost = self.round_trips.lost(pending, completed)
        if lost:
            self._drop(lost)
        if self._stop_requests:
            self._stop_jobs()
        self._hand_all(completed.started)
        if completed.start_error is not None:
            raise completed.start_error
        if replies.refusals:
            raise replies.refusal()
        return bool(completed.started)

    def _wait_for_work(self) -> None:
        """Idle: block on the queue for a while (or just wait, when not admitting); an
        engine that died meanwhile ends the loop first."""
        try:
            self.engine.check_alive()
        except EngineDeadError as exc:
            self._engine_died(exc)
            return
        if self._draining or self._suspended or len(self.inflight) >= self.capacity:
            time.sleep(_IDLE_WAIT_S)
            return
        first = self.connection.blmove(self.queue.key, self.queue.intermediate_queue_key, _IDLE_WAIT_S)
        if first is not None:
            self._hand_all(self._start_jobs([as_text(first)]))

    def _start_jobs(self, ids: list[str]) -> list[Started]:
        return start_jobs(self.connection, ids, self.queues, self.serializer, self.name, self.settings.heartbeat_ttl_s,
                          self.settings.stream_ttl_s, lambda pipeline: self.set_state(WorkerStatus.BUSY, pipeline))

    def _hand_all(self, items: list[Started]) -> bool:
        """Hand started jobs to the engine; whether there were any."""
        for item in items:
            self._hand_to_engine(item)
        return bool(items)

    def _hand_to_engine(self, item: Started) -> None:
        job, execution = item.job, item.execution
        earlier = self.inflight.of_job(job.id)
        if earlier is not None:
            # Reaped after a stall of this worker (its heartbeats stopped) and taken again by
            # it, before a check said the earlier run was no longer its own: that run is not.
            self._drop([earlier])
        queue = self._queues_by_name.get(job.origin, self.queue)
        self.executions[execution.id] = execution
        # Before the engine has it: a core in its own process may time the first token before add_to returns.
        entry = InFlight(job, queue, execution, item.payload, started_at=time.time())
        try:
            if item.error is not None:
                raise item.error[1]
            # In flight before the engine has it, and beaten meanwhile as in a step: a request's
            # input processing (tokenizing, a grammar's conversion) can outlast the heartbeat
            # TTL, and this job and every other here were reaped.
            self.inflight.add(entry)
            with self.heartbeats.step():
                item.payload.add_to(self.engine, execution.id, self.publisher.report_every_s(item.payload.stream))
        except Exception:
            if entry in self.inflight:
                self.inflight.remove(entry)  # the engine refused it: never had it
            # Bad input (InvalidJob: the client's error) fails the same way on every attempt: never retried.
            job.retries_left = 0
            self._finalize_failure(job, queue, execution, sys.exc_info())

    # ---- the engine step ------------------------------------------------------------

    def _step(self) -> None:
        """One engine step. Only finished requests' outputs come back at once: the running
        ones' are built when the next round trip is queued (_send_sync), once however
        many steps ran while the last one was out."""
        try:
            with self.heartbeats.step():
                outputs = self.engine.step(defer_outputs=True)
        except EngineDeadError as exc:
            self._engine_died(exc)
            return
        except Exception:
            self._fail_inflight(sys.exc_info())
            return
        self.inflight.take_outputs(outputs)

    def _engine_died(self, exc: EngineDeadError) -> None:
        """The engine is gone (its core process, or a tensor-parallel rank). Its jobs go as
        a dead worker's do (the reaper's requeue): each spends a retry and runs again
        elsewhere, so a request that kills every engine it runs on fails once its retries
        are spent instead of taking down every worker in turn. Then the loop ends as a
        drain's does, at once, and this worker leaves (its exit status says why) rather
        than take jobs it cannot run."""
        self.log.error("Worker %s: the engine died (%s); its jobs are retried elsewhere and it stops", self.name, exc)
        self._engine_dead = exc
        self._fail_inflight((type(exc), exc, exc.__traceback__))
        self._draining, self._drain_deadline = True, 0.0

    # ---- how jobs end here ----------------------------------------------------------

    def _record_successes(self, entries: list[InFlight], lost_positions: list[int]) -> None:
        """The round trip wrote these jobs' results, except at `lost_positions` (no longer ours)."""
        lost = {entries[position - 1].request_id for position in lost_positions}
        for entry in entries:
            if entry.request_id in lost:
                self.log.info("Worker %s: job %s finished here but is no longer ours: result not recorded", self.name, entry.job.id)
            else:
                self.metrics.observe_finished(entry.final, entry.payload.enqueued_at, entry.payload.sampling.n,
                                              entry.payload.sampling.max_tokens)
            self.executions.pop(entry.execution.id, None)
            self.inflight.remove(entry)

    def _drop(self, lost: list[InFlight]) -> None:
        """Canceled, deleted, or reaped and requeued after a stall: no longer ours to
        finish. Aborting frees their KV blocks now."""
        self.inflight.abort(lost)
        with self.connection.pipeline() as pipeline:
            for entry in lost:
                self.cleanup_execution(entry.job, pipeline, entry.execution)
            # Canceled through RQ itself (the api's cancels set this already): kept as long as a result.
            expire_canceled(pipeline, [entry.job.key for entry in lost], self.settings.result_ttl_s)
            self.heartbeats.queue_engine_stats(pipeline)  # the freed blocks, now
            pipeline.execute()
        self.log.info("Worker %s: dropped %d canceled or reassigned jobs", self.name, len(lost))

    def _stop_jobs(self) -> None:
        requested, self._stop_requests = self._stop_requests, set()
        for entry in [entry for entry in self.inflight if entry.job.id in requested]:
            self.inflight.abort([entry])
            self._stopped_job_id = entry.job.id  # RQ then marks it STOPPED, never retried
            self._finalize_failure(entry.job, entry.queue, entry.execution, (JobStopped, JobStopped("stopped by request"), None))

    def _fail_alone(self, entries: list[InFlight]) -> None:
        """Fail requests that the engine (or their output) failed alone, for something they
        caused: they would again, so they are never retried; the others go on."""
        if not entries:
            return
        self.inflight.abort(entries)
        for entry in entries:
            entry.job.retries_left = 0
            self._end_streams_on_failure.add(entry.job.id)
            self._finalize_failure(entry.job, entry.queue, entry.execution,
                                   _raised(request_failure(entry.error, entry.final.invalid_input)))

    def _fail_inflight(self, exc_info) -> None:
        """The engine raised mid-step: its state is suspect, so every in-flight job fails
        (RQ requeues those with retries left)."""
        self.log.error("Worker %s: engine step failed", self.name, exc_info=exc_info)
        entries = list(self.inflight)
        self.inflight.abort(entries)
        for entry in entries:
            self._finalize_failure(entry.job, entry.queue, entry.execution, exc_info)

    def _requeue_inflight(self) -> None:
        if not self.inflight:
            return
        self.log.info("Worker %s: requeueing %d unfinished jobs", self.name, len(self.inflight))
        entries = list(self.inflight)
        self.inflight.abort(entries)
        # Fenced: a job reaped and rerun elsewhere meanwhile must not be queued again.
        # Last first, so they stand at the queue's front in the order they came.
        refused = self._write_fenced([outcomes.requeue(self, entry) for entry in reversed(entries)])
        if refused:
            self.log.info("Worker %s: %d of them were no longer ours: not requeued", self.name, len(refused))
        self.metrics.jobs_requeued += len(entries) - len(refused)

    def _write_fenced(self, writes: list[FencedWrite]) -> list[int]:
        """Send recorded writes now, each only if its execution still owns its job; the
        1-based positions of those refused."""
        with self.connection.pipeline(transaction=False) as pipeline:
            queue_fenced_commands(pipeline, writes)
            return pipeline.execute()[0]


def _raised(exc: BaseException):
    """exc_info for an exception made here, as RQ's failure handling takes it."""
    return type(exc), exc, None


def run_worker(settings: Settings) -> None:
    """Entry point of `pagedq worker`."""
    from worker.rq.engine_factory import build_engine

    connection = connect(settings.require_redis_url())
    connection.ping()
    worker = BatchWorker(build_engine(settings), settings, connection)
    freeze_startup_heap()
    worker.work()


def _cache_config(engine) -> dict[str, str]:
    """The labels of cache_config_info (vLLM's names for what this engine's cache is)."""
    args = engine.args
    return {
        "block_size": str(args.block_size), "cache_dtype": str(args.kv_cache_dtype),
        "enable_prefix_caching": str(args.enable_prefix_caching),
        "num_gpu_blocks": str(engine.core_info.num_gpu_blocks),
        "num_cpu_blocks": str(engine.core_info.num_cpu_blocks), "swap_space": str(args.swap_space),
    }
