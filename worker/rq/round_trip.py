"""What the batch worker's one Redis round trip per tick carries and what comes back, by name.

The round trip is one pipeline: the publish script (the step's deltas and partial
results), the fenced success writes of the jobs the engine finished, the engine stats,
then SYNC_SCRIPT, which says what the worker must learn from Redis. Its replies are read
into `RoundTripReplies`, each part its own reply or the refusal Redis gave in its place
(the pipeline runs with raise_on_error off), so each part is retried or not on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from rq.job import JobStatus
from rq.queue import Queue
from rq.utils import as_text

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
