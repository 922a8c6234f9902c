"""`pagedq worker`: an RQ worker that runs many jobs at once through one continuous-batching engine.

RQ's own workers run one job per process. `BatchWorker` keeps RQ's bookkeeping (birth
and death, executions, the started registry, success and failure handling with Retry),
so `rq info`, `Job.fetch(id).get_status()` and `return_value()` tell the truth, and
replaces the work loop. One tick:

1. reap, when due: requeue the jobs of workers whose heartbeats stopped (a short TTL,
   checked often) and the ids a dead worker took from a queue but never started, and read
   the suspension flag;
2. heartbeat, when due: the worker and every execution, in one pipeline (and, from a
   thread, during a step that runs longer than a third of the TTL: step_heartbeats.py);
3. queue the round trip of what the previous step produced (`_send_sync`) and hand it to
   the I/O thread: every job's new text to its stream and partial result to its hash, the
   results of the jobs it finished (RQ's success writes, one script call for all of them)
   with their streams' "end", the engine stats to the worker's hash, and SYNC_SCRIPT
   (worker/rq/round_trip.py, where the round trip's parts and replies are named): the api's
   cancel counter, which in-flight jobs are no longer ours, and up to the free capacity of
   new job ids (taken only while the engine has no backlog, so queued jobs stay in Redis
   for other workers): from the interactive queue first, then from the batch queue
   (redis_schema.batch_queue_name), whose jobs never fill the slots reserved for
   interactive ones (`reserved_interactive_slots`). The I/O thread then marks the new
   jobs started in one transaction (worker/rq/job_starts.py);
4. step the engine once, while that round trip runs: the engine never waits for Redis.
   If the round trip is still out after the step (Redis, the api and the clients share
   the machine's cores), the next tick steps again without sending: what the steps
   produce meanwhile goes in the next round trip, each job's text since its last send as
   one delta, so a Redis that falls behind gets fewer, larger writes instead of a queue;
5. take the round trip's answer (`_complete_sync`): jobs no longer ours (canceled,
   deleted, reaped after a stall) are aborted in the engine, which frees their KV blocks;
   a job named by RQ's stop-job command fails as STOPPED; finished jobs are forgotten; the
   started ones go to the engine (or, idle, block on the queue for a second). The engine
   waits for a round trip only when it has nothing to compute.

What the worker keeps per job and per round trip is in worker/rq/inflight.py.

Every write for a job is fenced: it happens only if the job's execution still owns it,
checked in the same script (redis_schema's owns()), so a worker that stalled past its
heartbeat TTL, and whose jobs were rerun elsewhere, writes nothing for them when it wakes.

Metrics (pagedq.metrics, on `metrics_port`) cost the loop a few additions per output.

Each execution is its own engine request (its id is the request id), so a job that comes
back to this worker after being requeued can never be confused with its earlier run.

Redis going away: every Redis error is retried a second later, forever; the engine pauses
(a tick fails when its round trip does) and what was not yet published or finished is kept
and sent once Redis answers. Heartbeats go first after an outage, so a short one does not get
this worker's jobs reaped; after a long one they are requeued and run again, once.

SIGTERM stops admission and lets in-flight jobs finish for `drain_timeout_s`; what is
left is requeued at the front. A second signal requeues at once.
"""

from __future__ import annotations

import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import redis.exceptions
from redis import Redis
from rq import worker_registration
from rq.command import parse_payload
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.utils import as_text
from rq.utils import now as utcnow
from rq.worker import BaseWorker, WorkerStatus

from pagedq.front.core_client import EngineDeadError
from pagedq.gc_tuning import freeze_startup_heap
from pagedq.metrics import WorkerMetrics
from pagedq.outputs import RequestOutput
from pagedq.protocol import GenerationResult
from pagedq.redis_connection import connect, passing_redis_trouble
from pagedq.redis_schema import (
    FencedWrite,
    RequestFailed,
    batch_queue_name,
    cancels_key,
    expire_canceled,
    queue_fenced_commands,
)
from pagedq.settings import Settings
from worker.rq import outcomes
from worker.rq.inflight import InFlight, PendingSync, Started
from worker.rq.job_starts import start_jobs
from worker.rq.publisher import ProgressPublisher
from worker.rq.reaper import Reaper
from worker.rq.round_trip import CheckedJob, RoundTripReplies, SyncAnswer, call_sync
from worker.rq.step_heartbeats import StepHeartbeats

if TYPE_CHECKING:
    from pagedq.front.llm_engine import LLMEngine

# How long an idle worker waits for a job (or sleeps while suspended) before its next tick.
_IDLE_WAIT_S = 1.0
# Pause after a Redis error before the next try.
_REDIS_RETRY_S = 1.0
# One engine step longer than this is taken for a hung engine: its heartbeats stop.
_MAX_STEP_S = 600.0


class JobStopped(Exception):
    """The job was stopped with RQ's stop-job command."""


class BatchWorker(BaseWorker):
    log_result_lifespan = False

    def __init__(self, engine: LLMEngine, settings: Settings, connection: Redis):
        super().__init__(
            [settings.queue_name, batch_queue_name(settings.queue_name)],  # in order of preference
            connection=connection,
            serializer=JSONSerializer,
            worker_ttl=settings.heartbeat_ttl_s,
            log_job_description=False,  # descriptions hold prompts
        )
        self.engine = engine
        self.settings = settings
        self.queue, self.batch_queue = self.queues
        self._queues_by_name = {queue.name: queue for queue in self.queues}
        # By engine request id (= execution id).
        self.inflight: dict[str, InFlight] = {}
        self.publisher = ProgressPublisher(connection, settings.stream_ttl_s, settings.progress_interval_s, settings.stream_interval_s)
        self.capacity = min(settings.max_inflight, settings.max_num_seqs)
        self.batch_capacity = max(1, self.capacity - settings.reserved_interactive_slots)
        self.metrics = WorkerMetrics(
            [queue.name for queue in self.queues], settings.model_id, engine.max_model_len, _cache_config(engine),
            settings.metrics_prefix,
        )
        self.metrics_port: int | None = None
        self.reaper = Reaper(connection, self.queues, self.serializer, settings.heartbeat_ttl_s, self.log, self.name)
        # Job ids named by stop-job commands; filled by RQ's pubsub thread.
        self._stop_requests: set[str] = set()
        # Jobs whose failure also ends their stream ("end", failed), in the same fenced write.
        self._end_streams_on_failure: set[str] = set()
        self._draining = False
        self._drain_deadline = math.inf
        self._suspended = False
        self._next_reap = 0.0
        self._next_heartbeat = 0.0
        self._engine_dead: EngineDeadError | None = None  # set when a step finds the engine gone
        self._next_full_check = 0.0
        self._cancels_seen = b""
        # Runs each tick's Redis round trip while the engine steps.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="redis-io")
        # The round trip on the I/O thread, until its answer is taken (one at a time).
        self._pending: PendingSync | None = None
        # Beats while a step runs longer than the loop's beats allow (worker/rq/step_heartbeats.py).
        self._step_heartbeats = StepHeartbeats(lambda: self._heartbeat(engine_stats=False),
                                               settings.heartbeat_ttl_s / 3, _MAX_STEP_S, self.log)

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
        self._step_heartbeats.start()
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
                    self._next_heartbeat = self._next_full_check = 0.0
                    time.sleep(_REDIS_RETRY_S)
            if self._pending is not None:
                self._take_pending()
            self._sync_with_redis(admit=False, full=True)
            self._requeue_inflight()
            if self._engine_dead is not None:
                raise self._engine_dead
        finally:
            self._step_heartbeats.stop()
            self._io.shutdown(wait=True)
            self.teardown()

    def _tick(self) -> None:
        if time.monotonic() >= self._next_reap:
            self._reap()
        if time.monotonic() >= self._next_heartbeat:
            self._heartbeat()
        # The round trip of what earlier steps produced (deltas, finished jobs' results,
        # checks, new jobs started) runs on the I/O thread while the engine computes.
        if self._pending is None:
            self._pending = self._send_sync()
        if self.engine.has_unfinished_requests():
            self._step()
            if not self._pending.future.done():
                return  # Redis is behind the engine: step on; the next round trip carries this step's output
        started = self._take_pending()
        if not started and not self.engine.has_unfinished_requests() and not self._has_finals():
            self._wait_for_work()

    def _take_pending(self) -> bool:
        """Wait for the round trip out and act on its answer (_complete_sync)."""
        pending, self._pending = self._pending, None
        return self._complete_sync(pending)

    def _has_finals(self) -> bool:
        return any(entry.final is not None for entry in self.inflight.values())

    def _reap(self) -> None:
        """Requeue what dead workers left (worker/rq/reaper.py), read the suspension flag,
        and run RQ's maintenance when due."""
        self.metrics.jobs_requeued += self.reaper.reap()
        suspended = bool(is_suspended(self.connection))
        if suspended != self._suspended:
            self._suspended = suspended
            self._next_heartbeat = 0.0  # show the new state now
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()
        self._next_reap = time.monotonic() + self.settings.reaper_interval_s

    # ---- admission and in-flight checks --------------------------------------------

    def _sync_with_redis(self, admit: bool = True, full: bool = False) -> None:
        """One round trip, waited for (see _send_sync)."""
        self._complete_sync(self._send_sync(admit, full))

    def _send_sync(self, admit: bool = True, full: bool = False) -> PendingSync:
        """Queue one round trip and start it on the I/O thread: the step's deltas and
        partial results (fenced), the results of the jobs it finished (RQ's success
        writes, fenced, then each stream's "end"), the engine stats, and SYNC_SCRIPT: the
        cancel counter, which in-flight jobs are no longer ours, and new job ids (while
        admitting: capacity left and no backlog in the engine, so queued jobs stay in
        Redis for other workers), which the I/O thread then marks started.

        Every in-flight job is checked when the api's cancel counter moved (so a cancel
        aborts its job within a step), every reaper interval (cancels made through RQ
        directly), and after a Redis outage. Writes need no check of their own: each is
        fenced (owns() in redis_schema), so a job reaped after a stall and rerun elsewhere
        never gets a write from here."""
        # Only the outputs the publisher sends now are built (text decoded): a job nobody
        # streams sends a delta every progress_interval_s, not every round trip.
        self._take_outputs(self.engine.deferred_outputs(self._delta_due))
        self._fail_alone([entry for entry in self.inflight.values() if entry.final is not None and not self._result_of(entry)])
        entries = list(self.inflight.values())
        full = full or time.monotonic() >= self._next_full_check
        take = batch_take = 0
        running = [entry for entry in entries if entry.final is None]
        if admit and not self._draining and not self._suspended and self.engine.stats()["num_waiting"] == 0:
            # Jobs the engine has finished are recorded in this round trip: their slots are free already.
            take = max(0, self.capacity - len(running))
            batch_take = max(0, self.batch_capacity - sum(entry.queue is self.batch_queue for entry in running))
        pending = PendingSync(checked=running if full else [], full=full)
        by_job_id = {entry.job.id: entry for entry in entries}
        pipeline = self.connection.pipeline(transaction=False)
        pending.sending = self.publisher.publish(pipeline, lambda job_id: by_job_id[job_id].execution.composite_key)
        pending.finishing = [entry for entry in entries if entry.final is not None]
        if pending.finishing:
            self._queue_successes(pipeline, pending.finishing)
        self._publish_engine_stats(pipeline)
        self._call_sync(pipeline, take, [take, batch_take], pending.checked)
        pending.future = self._io.submit(self._run_sync, pipeline, pending)
        return pending

    def _delta_due(self, request_id: str) -> bool:
        entry = self.inflight.get(request_id)
        return entry is None or self.publisher.due(entry.job.id)

    def _call_sync(self, target, take: int, limits: list[int], checked: list[InFlight]):
        """round_trip.call_sync for this worker's queues and the given in-flight jobs."""
        return call_sync(target, cancels_key(self.queue.name), self.queues, take, limits,
                         [CheckedJob(entry.job.key, entry.queue.started_job_registry.key, entry.execution.composite_key)
                          for entry in checked], self.name)

    def _run_sync(self, pipeline, pending: PendingSync) -> tuple[RoundTripReplies, list[Started], Exception | None]:
        """On the I/O thread: the round trip, then the start of the jobs it took. Each
        command's reply comes back on its own, a refusal in its place (raise_on_error
        off): a script Redis refused wrote nothing (Redis refuses a script at its first
        write, never half way), one it ran wrote everything, so each part is retried or
        not by its own reply. A Redis error in the start comes back beside the replies;
        the ids taken but not started are requeued by a reaper, as a dead worker's are."""
        with pipeline:
            replies = RoundTripReplies.read(pipeline.execute(raise_on_error=False), pending.sending.queued,
                                            bool(pending.finishing))
        if isinstance(replies.sync, Exception):
            return replies, [], None
        taken = replies.sync.taken
        try:
            return replies, self._start_jobs(taken) if taken else [], None
        except redis.exceptions.RedisError as exc:
            if passing_redis_trouble(exc) is None:
                raise
            return replies, [], exc

    def _complete_sync(self, pending: PendingSync) -> bool:
        """Wait for the round trip and act on what it says; True if jobs were started."""
        try:
            replies, started, start_error = pending.future.result()
        except BaseException:
            self.publisher.uncertain(pending.sending)  # the pipeline may have run before the reply was lost
            raise
        lost_ids: list[str] = []
        if isinstance(replies.published, Exception):
            self.publisher.failed(pending.sending)  # nothing was written: sent again next time
        elif pending.sending.queued:
            lost_ids = self.publisher.published(pending.sending, replies.published)
        if pending.finishing and not isinstance(replies.successes, Exception):
            # (Refused: the jobs keep their final output and are recorded by a later round trip.)
            self._record_successes(pending.finishing, replies.successes)
        sync = replies.sync
        if isinstance(sync, Exception):
            # Nothing learned of cancels or new jobs this time: the next round trip asks again.
            raise _first_refusal(replies.refusals)
        self.metrics.queue_depth = {queue.name: depth for queue, depth in zip(self.queues, sync.depths)}
        lost = {pending.checked[position - 1].request_id: pending.checked[position - 1] for position in sync.lost_positions}
        for entry in self.inflight.values():
            if entry.job.id in lost_ids:
                lost[entry.request_id] = entry
        full = pending.full
        if not full and sync.cancels != self._cancels_seen:
            # A job was canceled somewhere: look at every one of ours now.
            self._check_all(lost)
            full = True
        self._cancels_seen = sync.cancels
        if full:
            self._next_full_check = time.monotonic() + self.settings.reaper_interval_s
        if lost:
            self._drop([entry for entry in lost.values() if entry.request_id in self.inflight])
        if self._stop_requests:
            self._stop_jobs()
        for item in started:
            self._hand_to_engine(item)
        if start_error is not None:
            raise start_error
        if replies.refusals:
            raise _first_refusal(replies.refusals)
        return bool(started)

    def _check_all(self, lost: dict[str, InFlight]) -> None:
        running = [entry for entry in self.inflight.values() if entry.final is None]
        answer = SyncAnswer.read(self._call_sync(self.connection, 0, [0, 0], running))
        for position in answer.lost_positions:
            lost[running[position - 1].request_id] = running[position - 1]

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
            for item in self._start_jobs([as_text(first)]):
                self._hand_to_engine(item)

    def _start_jobs(self, ids: list[str]) -> list[Started]:
        return start_jobs(self.connection, ids, self.queues, self.serializer, self.name, self.settings.heartbeat_ttl_s,
                          self.settings.stream_ttl_s, lambda pipeline: self.set_state(WorkerStatus.BUSY, pipeline))

    def _hand_to_engine(self, item: Started) -> None:
        job, execution = item.job, item.execution
        queue = self._queues_by_name.get(job.origin, self.queue)
        self.executions[execution.id] = execution
        # Before the engine has it: a core in its own process may time the first token before add_to returns.
        started_at = time.time()
        try:
            if item.error is not None:
                raise item.error[1]
            item.payload.add_to(self.engine, execution.id)
        except Exception:
            # Bad input (InvalidJob: the client's error) fails the same way on every attempt: never retried.
            job.retries_left = 0
            self._finalize_failure(job, queue, execution, sys.exc_info())
            return
        self.inflight[execution.id] = InFlight(job, queue, execution, item.payload, started_at=started_at)
        self.publisher.track(job, stream=item.payload.stream)

    def _drop(self, lost: list[InFlight]) -> None:
        """Canceled, deleted, or reaped and requeued after a stall: no longer ours to
        finish. Aborting frees their KV blocks now."""
        self._forget(lost)
        with self.connection.pipeline() as pipeline:
            for entry in lost:
                self.cleanup_execution(entry.job, pipeline, entry.execution)
            # Canceled through RQ itself (the api's cancels set this already): kept as long as a result.
            expire_canceled(pipeline, [entry.job.key for entry in lost], self.settings.result_ttl_s)
            self._publish_engine_stats(pipeline)  # the freed blocks, now
            pipeline.execute()
        self.log.info("Worker %s: dropped %d canceled or reassigned jobs", self.name, len(lost))

    def _stop_jobs(self) -> None:
        requested, self._stop_requests = self._stop_requests, set()
        for entry in [entry for entry in self.inflight.values() if entry.job.id in requested]:
            self._forget([entry])
            self._stopped_job_id = entry.job.id  # RQ then marks it STOPPED, never retried
            self._finalize_failure(entry.job, entry.queue, entry.execution, (JobStopped, JobStopped("stopped by request"), None))

    def _forget(self, entries: list[InFlight]) -> None:
        self.engine.abort_request([entry.request_id for entry in entries])
        for entry in entries:
            del self.inflight[entry.request_id]
            self.publisher.forget(entry.job.id)

    # ---- engine step ----------------------------------------------------------------

    def _step(self) -> None:
        """One engine step. Only finished requests' outputs come back at once: the running
        ones' are built when the next round trip is queued (_take_outputs), once however
        many steps ran while the last one was out."""
        try:
            with self._step_heartbeats.step():
                outputs = self.engine.step(defer_outputs=True)
        except EngineDeadError as exc:
            self._engine_died(exc)
            return
        except Exception:
            self._fail_inflight(sys.exc_info())
            return
        self._take_outputs(outputs)

    def _take_outputs(self, outputs: list[RequestOutput]) -> None:
        """Record outputs for the publisher and the metrics; finished ones end their jobs.
        A job's tokens since its last output (or since its first token) are taken to have
        come evenly: one inter-token latency per gap, summing to the time that passed."""
        now = time.time()
        for output in outputs:
            entry = self.inflight.get(output.request_id)
            if entry is None:
                continue  # dropped before this step
            self.publisher.update(entry.job.id, output)
            num_tokens = len(output.outputs[0].token_ids)
            if num_tokens > entry.num_tokens:
                since, counted = entry.last_token_at, entry.num_tokens
                if not counted:
                    since, counted = output.metrics.first_token_time or now, 1
                if num_tokens > counted:
                    latency = max(now - since, 0.0) / (num_tokens - counted)
                    self.metrics.inter_token_latency.observe(latency, num_tokens - counted)
                entry.num_tokens, entry.last_token_at = num_tokens, now
            if output.finished:
                entry.final = output

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

    def _queue_successes(self, pipeline, entries: list[InFlight]) -> None:
        """Queue RQ's success writes for each finished job (worker/rq/outcomes.py), fenced,
        as one script call."""
        settings = self.settings
        queue_fenced_commands(pipeline, [outcomes.success(self, entry, settings.heartbeat_ttl_s, settings.stream_ttl_s)
                                         for entry in entries])

    def _result_of(self, entry: InFlight) -> bool:
        """Build a finished request's result once; False if the engine failed it alone
        (entry.final.error) or its result cannot be built (the error is kept in `error`)."""
        if entry.result is None and entry.error is None:
            entry.error = entry.final.error
            if entry.error is None:
                try:
                    entry.result = GenerationResult.from_output(entry.final, entry.job.id, entry.payload, entry.started_at)
                except Exception as exc:  # this job's output alone: the others are recorded
                    self.log.exception("Worker %s: the result of %s could not be built", self.name, entry.job.id)
                    entry.error = f"its result could not be recorded: {exc!r}"
        return entry.result is not None

    def _fail_alone(self, entries: list[InFlight]) -> None:
        """Fail requests that the engine (or their output) failed alone, for something they
        caused: they would again, so they are never retried; the others go on."""
        if not entries:
            return
        self._forget(entries)
        for entry in entries:
            entry.job.retries_left = 0
            self._end_streams_on_failure.add(entry.job.id)
            self._finalize_failure(entry.job, entry.queue, entry.execution, _raised(RequestFailed(entry.error)))

    def _record_successes(self, entries: list[InFlight], lost_positions: list[int]) -> None:
        lost = {entries[position - 1].request_id for position in lost_positions}
        for entry in entries:
            if entry.request_id in lost:
                self.log.info("Worker %s: job %s finished here but is no longer ours: result not recorded", self.name, entry.job.id)
            else:
                self.metrics.observe_finished(entry.final, entry.payload.enqueued_at, entry.payload.sampling.n,
                                              entry.payload.sampling.max_tokens)
            self.executions.pop(entry.execution.id, None)
            del self.inflight[entry.request_id]
            self.publisher.forget(entry.job.id)

    def _fail_inflight(self, exc_info) -> None:
        """The engine raised mid-step: its state is suspect, so every in-flight job fails
        (RQ requeues those with retries left)."""
        self.log.error("Worker %s: engine step failed", self.name, exc_info=exc_info)
        entries = list(self.inflight.values())
        self._forget(entries)
        for entry in entries:
            self._finalize_failure(entry.job, entry.queue, entry.execution, exc_info)

    # ---- heartbeats and shutdown ----------------------------------------------------

    def _heartbeat(self, engine_stats: bool = True) -> None:
        """`engine_stats` False: from the step heartbeats' thread, while the engine computes."""
        ttl = self.settings.heartbeat_ttl_s
        with self.connection.pipeline(transaction=False) as pipeline:
            self.heartbeat(ttl, pipeline=pipeline)
            for entry in self.inflight.values():
                entry.execution.heartbeat(entry.queue.started_job_registry, ttl, pipeline)
            state = WorkerStatus.SUSPENDED if self._suspended else WorkerStatus.BUSY if self.inflight else WorkerStatus.IDLE
            self.set_state(state, pipeline)
            if engine_stats:
                self._publish_engine_stats(pipeline)
            created = pipeline.execute()[0]
            if created:
                # Our hash expired while Redis was away (or was lost with it): without its
                # other fields and registration, nobody would count this worker.
                pipeline.hset(self.key, mapping=self.serialize())
                worker_registration.register(self, pipeline)
                pipeline.expire(self.key, ttl)
                pipeline.execute()
        self._next_heartbeat = time.monotonic() + ttl / 3

    def _publish_engine_stats(self, pipeline) -> None:
        """The engine's block accounting in the worker's hash, for /ready (and tests).
        Sent with every step's round trip, so it is at most one step old; the metrics read it too."""
        self.metrics.observe_step(self.engine.stats())
        pipeline.hset(self.key, "engine_stats", json.dumps(self.metrics.engine_stats))

    def _requeue_inflight(self) -> None:
        if not self.inflight:
            return
        self.log.info("Worker %s: requeueing %d unfinished jobs", self.name, len(self.inflight))
        entries = list(self.inflight.values())
        self._forget(entries)
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


def _first_refusal(refusals: list[Exception]) -> Exception:
    """What to raise for a round trip Redis refused parts of: trouble that passes (the
    work loop waits it out), unless one refusal is of another kind (a bug: raised)."""
    return next((exc for exc in refusals if passing_redis_trouble(exc) is None), refusals[0])


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
