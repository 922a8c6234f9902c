"""The batch worker's one Redis round trip per tick: what it carries, how it runs beside
the engine, and what comes back, by name.

The round trip is one pipeline: the publish script (the step's deltas and partial
results), the fenced success writes of the jobs the engine finished, the engine stats,
then SYNC_SCRIPT, which says what the worker must learn from Redis. `RoundTrips.send()`
queues it and runs it on an I/O thread while the engine steps; the thread then marks the
jobs it took started (worker/rq/job_starts.py), a chunk at a time, and the engine thread
hands each chunk to the engine between its steps (`take_started()`), or, idle, as soon as the
first is started (`first_started()`). Its replies are read into
`RoundTripReplies`, each part its own reply or the refusal Redis gave in its place (the
pipeline runs with raise_on_error off), so each part is retried or not on its own.

Writes need no check of their own: each is fenced (owns() in redis_schema), so a job
reaped after a stall and rerun elsewhere never gets a write from here. Which in-flight
jobs are still ours is checked when the api's cancel counter moved (so a cancel aborts
its job within a step), every reaper interval (cancels made through RQ directly), and
after a Redis outage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from queue import SimpleQueue

import redis.exceptions
from redis.client import Pipeline
from rq.job import JobStatus
from rq.queue import Queue
from rq.utils import as_text
from rq.worker import BaseWorker

from pagedq.redis_connection import passing_redis_trouble
from pagedq.redis_schema import cancels_key, queue_fenced_commands
from worker.rq import outcomes
from worker.rq.inflight import InFlight, InFlightJobs, PendingSync, Started
from worker.rq.publisher import ProgressPublisher

# Jobs a round trip took are started (RQ's bookkeeping, ~1 ms each on a 2-core host) this
# many at a time, each chunk ready for the engine as soon as it is: the engine prefills
# the first while the rest are started. All at once, a burst's 238 jobs took 291 ms to
# start before the engine had any of them. About two steps' prefill of 128-token prompts
# at the default token budget (2,048).
_START_CHUNK = 32

# 1. the api's cancel counter (see redis_schema.cancels_key);
# 2. which of the given in-flight jobs are no longer ours to run: not started (canceled,
#    requeued), run by another worker, or this execution gone from its queue's started
#    registry (reaped after a stall); their positions, 1-based;
# 3. up to ARGV[3] new job ids, moved from a queue to its intermediate list (RQ's
#    crash-safe hand-off): from each queue in turn, at most its own limit from each;
# 4. each queue's length after that.
# KEYS: the cancel counter, (queue, intermediate list) per queue in order of preference,
# then (job hash, its queue's started registry) per checked job. ARGV: the started status,
# this worker's name, how many ids to take, the number of queues, each queue's limit, then
# each checked job's execution composite key.
SYNC_SCRIPT = """
local queues = tonumber(ARGV[4])
local first_job = 2 + 2 * queues
local lost = {}
for i = first_job, #KEYS, 2 do
    local n = (i - first_job) / 2 + 1
    local job = redis.call('HMGET', KEYS[i], 'status', 'worker_name')
    if job[1] ~= ARGV[1] or job[2] ~= ARGV[2] or not redis.call('ZSCORE', KEYS[i + 1], ARGV[4 + queues + n]) then
        lost[#lost + 1] = n
    end
end
local taken, depths = {}, {}
local want = tonumber(ARGV[3])
for q = 1, queues do
    local limit = tonumber(ARGV[4 + q])
    while #taken < want and limit > 0 do
        local id = redis.call('LMOVE', KEYS[2 * q], KEYS[2 * q + 1], 'LEFT', 'RIGHT')
        if not id then break end
        taken[#taken + 1] = id
        limit = limit - 1
    end
    depths[q] = redis.call('LLEN', KEYS[2 * q])
end
return {redis.call('GET', KEYS[1]) or '0', lost, taken, depths}
"""


@dataclass(frozen=True)
class CheckedJob:
    """An in-flight job SYNC_SCRIPT checks is still ours."""

    job_key: str
    started_registry_key: str
    execution_key: str


@dataclass(frozen=True)
class SyncAnswer:
    """SYNC_SCRIPT's reply."""

    cancels: bytes
    # Positions (1-based) of the checked jobs no longer ours.
    lost_positions: list[int]
    # Ids moved to their queue's intermediate list, for this worker to start.
    taken: list[str]
    # Each queue's length, in the order the queues were given.
    depths: list[int]

    @classmethod
    def read(cls, reply: list) -> SyncAnswer:
        cancels, lost_positions, taken, depths = reply
        return cls(cancels, list(lost_positions), [as_text(i) for i in taken], list(depths))


def call_sync(target, cancels_key: str, queues: list[Queue], take: int, limits: list[int], checked: list[CheckedJob],
              worker_name: str):
    """SYNC_SCRIPT on `target`: a pipeline (queued; its reply comes with the pipeline's) or a
    connection (run now: its reply). It takes up to `take` ids in all, at most `limits[q]`
    from queue q."""
    keys = [cancels_key]
    for queue in queues:
        keys += [queue.key, queue.intermediate_queue_key]
    for job in checked:
        keys += [job.job_key, job.started_registry_key]
    args = [JobStatus.STARTED.value, worker_name, take, len(queues), *limits,
            *(job.execution_key for job in checked)]
    # EVAL, not EVALSHA: a pipeline cannot reload a script a restarted Redis forgot.
    return target.eval(SYNC_SCRIPT, len(keys), *keys, *args)


@dataclass(frozen=True)
class RoundTripReplies:
    """The round trip's replies by part; each is the part's reply, the exception Redis
    refused it with, or None for a part the round trip did not carry."""

    published: list | Exception | None
    successes: list | Exception | None
    sync: SyncAnswer | Exception
    # Every refusal in the pipeline, these parts' and the others' (the engine stats).
    refusals: list[Exception]

    @classmethod
    def read(cls, replies: list, published: bool, successes: bool) -> RoundTripReplies:
        """`replies` of a pipeline queued as: the publish script (if `published`), the
        success writes (if `successes`), anything else, then SYNC_SCRIPT last."""
        parts = iter(replies)
        published_reply = next(parts) if published else None
        successes_reply = next(parts) if successes else None
        sync = replies[-1]
        return cls(published_reply, successes_reply, sync if isinstance(sync, Exception) else SyncAnswer.read(sync),
                   [reply for reply in replies if isinstance(reply, Exception)])

    def refusal(self) -> Exception | None:
        """What to raise for the parts Redis refused: trouble that passes (the work loop
        waits it out), unless one refusal is of another kind (a bug: raised)."""
        if not self.refusals:
            return None
        return next((exc for exc in self.refusals if passing_redis_trouble(exc) is None), self.refusals[0])


@dataclass(frozen=True)
class Completed:
    """A round trip that ran: its replies, the jobs the I/O thread started that the engine
    thread has not taken yet (take_started()), the Redis
    error that cut their start short (the ids taken but not started are requeued by a
    reaper, as a dead worker's are), and the jobs the publish script refused to write for
    (no longer ours)."""

    replies: RoundTripReplies
    started: list[Started]
    start_error: Exception | None
    refused_job_ids: list[str]


class RoundTrips:
    """Sends the worker's round trips on an I/O thread (one at a time) and reads them back:
    the publisher learns what was sent, and `lost()` which in-flight jobs are no longer ours."""

    def __init__(self, worker: BaseWorker, inflight: InFlightJobs, publisher: ProgressPublisher, *,
                 heartbeat_ttl_s: int, stream_ttl_s: int, full_check_interval_s: float,
                 queue_engine_stats: Callable[[Pipeline], None], start_jobs: Callable[[list[str]], list[Started]]):
        # The RQ worker whose name, queues and counters the round trip's writes carry.
        self._worker = worker
        self._inflight = inflight
        self._publisher = publisher
        self._heartbeat_ttl_s = heartbeat_ttl_s
        self._stream_ttl_s = stream_ttl_s
        self._full_check_interval_s = full_check_interval_s
        self._queue_engine_stats = queue_engine_stats
        self._start_jobs = start_jobs
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="redis-io")
        # Chunks of jobs the I/O thread started, for the engine thread.
        self._started: SimpleQueue[list[Started]] = SimpleQueue()
        # Set once the round trip out has started a chunk, or has ended (first_started()).
        self._chunk_or_end = threading.Event()
        self._cancels_seen = b""
        self._next_full_check = 0.0

    def check_all_next(self) -> None:
        """The next round trip checks every in-flight job (after a Redis outage)."""
        self._next_full_check = 0.0

    def send(self, take: int, batch_take: int, full: bool = False) -> PendingSync:
        """Queue one round trip and start it on the I/O thread: what the publisher holds
        (fenced), the results of the jobs the engine finished (RQ's success writes, fenced,
        then each stream's "end"), the engine stats, and SYNC_SCRIPT, taking up to `take`
        new jobs in all and `batch_take` from the batch queue. `full`: check every in-flight
        job (else only when a check is due)."""
        full = full or time.monotonic() >= self._next_full_check
        pending = PendingSync(checked=self._inflight.running() if full else [], full=full)
        pipeline = self._worker.connection.pipeline(transaction=False)
        pending.sending = self._publisher.publish(pipeline)
        pending.finishing = self._inflight.finishing()
        if pending.finishing:
            queue_fenced_commands(pipeline, [outcomes.success(self._worker, entry, self._heartbeat_ttl_s, self._stream_ttl_s)
                                             for entry in pending.finishing])
        self._queue_engine_stats(pipeline)
        self._call_sync(pipeline, take, [take, batch_take], pending.checked)
        self._chunk_or_end.clear()
        pending.future = self._io.submit(self._run, pipeline, pending)
        return pending

    def wait(self, pending: PendingSync) -> Completed:
        """Wait for the round trip; the publisher learns what it sent. Raises what broke
        it off (the publisher then takes it as maybe sent)."""
        try:
            replies, start_error = pending.future.result()
        except BaseException:
            self._publisher.uncertain(pending.sending)  # the pipeline may have run before the reply was lost
            raise
        refused: list[str] = []
        if isinstance(replies.published, Exception):
            self._publisher.failed(pending.sending)  # nothing was written: sent again next time
        elif pending.sending.queued:
            refused = self._publisher.published(pending.sending, replies.published)
        return Completed(replies, self.take_started(), start_error, refused)

    def first_started(self) -> list[Started]:
        """For an idle engine: wait until the round trip out has started its first chunk of
        jobs, or has ended, and take what is started by then (none when it took no jobs)."""
        self._chunk_or_end.wait()
        return self.take_started()

    def take_started(self) -> list[Started]:
        """The jobs the I/O thread has started since the last call (without waiting)."""
        started: list[Started] = []
        while not self._started.empty():
            started += self._started.get_nowait()
        return started

    def lost(self, pending: PendingSync, completed: Completed) -> list[InFlight]:
        """The in-flight jobs a round trip Redis answered says are no longer ours:
        canceled, deleted, or reaped after a stall. When the api's cancel counter moved
        since the last look, every job is checked now (one more call)."""
        sync = completed.replies.sync
        lost = {pending.checked[position - 1].request_id: pending.checked[position - 1]
                for position in sync.lost_positions}
        if completed.refused_job_ids:  # rare: no look at every in-flight job otherwise
            refused = set(completed.refused_job_ids)
            for entry in self._inflight:
                if entry.job.id in refused:
                    lost[entry.request_id] = entry
        full = pending.full
        if not full and sync.cancels != self._cancels_seen:
            running = self._inflight.running()
            for position in SyncAnswer.read(self._call_sync(self._worker.connection, 0, [0, 0], running)).lost_positions:
                lost[running[position - 1].request_id] = running[position - 1]
            full = True
        self._cancels_seen = sync.cancels
        if full:
            self._next_full_check = time.monotonic() + self._full_check_interval_s
        return [entry for entry in lost.values() if entry in self._inflight]

    def shutdown(self) -> None:
        self._io.shutdown(wait=True)

    def _call_sync(self, target, take: int, limits: list[int], checked: list[InFlight]):
        worker = self._worker
        return call_sync(target, cancels_key(worker.queues[0].name), worker.queues, take, limits,
                         [CheckedJob(entry.job.key, entry.queue.started_job_registry.key, entry.execution.composite_key)
                          for entry in checked], worker.name)

    def _run(self, pipeline: Pipeline, pending: PendingSync) -> tuple[RoundTripReplies, Exception | None]:
        """On the I/O thread: the round trip, then the start of the jobs it took, a chunk
        at a time, each for take_started() as soon as it is started. Each
        command's reply comes back on its own, a refusal in its place (raise_on_error
        off): a script Redis refused wrote nothing (Redis refuses a script at its first
        write, never half way), one it ran wrote everything, so each part is retried or
        not by its own reply. A Redis error in the start comes back beside the replies."""
        try:
            return self._run_and_start(pipeline, pending)
        finally:
            self._chunk_or_end.set()

    def _run_and_start(self, pipeline: Pipeline, pending: PendingSync) -> tuple[RoundTripReplies, Exception | None]:
        with pipeline:
            replies = RoundTripReplies.read(pipeline.execute(raise_on_error=False), pending.sending.queued,
                                            bool(pending.finishing))
        if isinstance(replies.sync, Exception):
            return replies, None
        taken = replies.sync.taken
        try:
            for at in range(0, len(taken), _START_CHUNK):
                self._started.put(self._start_jobs(taken[at:at + _START_CHUNK]))
                self._chunk_or_end.set()
        except redis.exceptions.RedisError as exc:
            if passing_redis_trouble(exc) is None:
                raise
            return replies, exc
        return replies, None
