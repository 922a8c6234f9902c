"""The invariants, checked once the load has stopped and the queues have drained: no job
lost, none ended twice, none stuck, every client's text the job's result, every
deterministic result the offline engine's; and what Redis keeps: keys that never expire,
memory before and after.

The job checks read RQ's own records (`Job.fetch_many` with the JSON serializer, each
job's `results()`), of every job in Redis: a job no client learned about (a /v1 request
whose answer was cut off) must end too."""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from redis import Redis
from rq.job import Job
from rq.queue import Queue
from rq.registry import (
    CanceledJobRegistry,
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.suspension import WORKERS_SUSPENDED
from rq.worker import Worker

from pagedq.chaos.ledger import Ledger, Violation
from pagedq.redis_schema import EVENT_END, JOB_SERIALIZER, TERMINAL, job_state, stream_key
from pagedq.reference import offline_greedy

# RQ's own structures, which live as long as their queue or worker: queues (and their
# intermediate lists), the registries of each queue, workers, the suspension flag.
RQ_STRUCTURE_PREFIXES = (
    Queue.redis_queue_namespace_prefix, Queue.redis_queues_keys, Worker.redis_worker_namespace_prefix,
    Worker.redis_workers_keys, WORKERS_SUSPENDED,
    *(registry.key_template.format("") for registry in (
        StartedJobRegistry, FinishedJobRegistry, FailedJobRegistry, DeferredJobRegistry, ScheduledJobRegistry,
        CanceledJobRegistry,
    )),
)
# A part of a key that names one job, file, batch or api process (long, with a digit).
_ID_PART = re.compile(r"(?<=[:])(?=[^:]*\d)[^:]{16,}")
_SCAN_COUNT = 1000
# RQ's reason for failing a job whose workers kept dying: retries used up, not a bug of its own.
_ABANDONED = "AbandonedJobError"


@dataclass
class JobRecord:
    """One job as Redis has it at the end."""

    seq_id: str
    state: str  # queued, running, finished, failed, canceled (pagedq's names for RQ's statuses)
    results: int  # len(job.results()): RQ's record of each time it ended
    result: dict | None  # the return value, when finished
    error: str | None  # the failure's last line, when failed
    payload: dict  # the job's kwargs: prompt_token_ids, sampling, ...
    stream_ends: int  # "end" events in its stream (0 when it has none)


# ---- reading Redis ------------------------------------------------------------------


def job_ids(redis: Redis) -> list[str]:
    prefix = Job.redis_job_namespace_prefix
    keys = (key.decode() for key in redis.scan_iter(match=prefix + "*", count=_SCAN_COUNT))
    return sorted(key[len(prefix):] for key in keys if ":" not in key[len(prefix):])


def unended_job_ids(redis: Redis) -> list[str]:
    ids = job_ids(redis)
    with redis.pipeline(transaction=False) as pipeline:
        for seq_id in ids:
            pipeline.hget(Job.key_for(seq_id), "status")
        statuses = pipeline.execute()
    return [seq_id for seq_id, status in zip(ids, statuses) if status is not None and job_state(status) not in TERMINAL]


def wait_for_drain(redis: Redis, timeout_s: float) -> list[str]:
    """Wait until every job in Redis has ended; the ids of those that have not after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (left := unended_job_ids(redis)) and time.monotonic() < deadline:
        time.sleep(1.0)
    return left


def read_jobs(redis: Redis) -> dict[str, JobRecord]:
    ids = job_ids(redis)
    with redis.pipeline(transaction=False) as pipeline:
        for seq_id in ids:
            pipeline.xrange(stream_key(seq_id))
        streams = pipeline.execute()
    records = {}
    for job, stream in zip(Job.fetch_many(ids, connection=redis, serializer=JOB_SERIALIZER), streams):
        if job is None:  # expired since the scan
            continue
        state = job_state(job.get_status(refresh=False)) or "queued"
        latest = job.latest_result()
        failure = (latest.exc_string or "").strip().splitlines() if latest is not None and state == "failed" else []
        records[job.id] = JobRecord(
            seq_id=job.id, state=state, results=len(job.results()),
            result=job.return_value() if state == "finished" else None,
            error=failure[-1] if failure else None, payload=job.kwargs,
            stream_ends=sum(fields.get(b"type") == EVENT_END.encode() for _, fields in stream),
        )
    return records


def used_memory(redis: Redis) -> int:
    return redis.info("memory")["used_memory"]


@dataclass
class EndState:
    """What Redis holds once the load has stopped and the queues have drained."""

    jobs: dict[str, JobRecord]
    # Keys with no TTL that are not RQ structures, by pattern (see keys_without_ttl).
    keys_never_expiring: dict[str, int]
    fixed_keys_without_ttl: dict[str, int]
    used_memory: int


def read_end_state(redis: Redis) -> EndState:
    return EndState(read_jobs(redis), *keys_without_ttl(redis), used_memory(redis))


def keys_without_ttl(redis: Redis) -> tuple[dict[str, int], dict[str, int]]:
    """Keys with no TTL that are not RQ structures, counted by pattern (ids as `{id}`):
    (those that name one job, file or batch, which should expire but never do; the
    service's fixed-name keys)."""
    keys = [key.decode() for key in redis.scan_iter(count=_SCAN_COUNT)]
    candidates = [key for key in keys if not key.startswith(RQ_STRUCTURE_PREFIXES)]
    with redis.pipeline(transaction=False) as pipeline:
        for key in candidates:
            pipeline.ttl(key)
        ttls = pipeline.execute()
    patterns = Counter(_ID_PART.sub("{id}", key) for key, ttl in zip(candidates, ttls) if ttl == -1)
    per_item = {pattern: count for pattern, count in sorted(patterns.items()) if "{id}" in pattern}
    fixed = {pattern: count for pattern, count in sorted(patterns.items()) if "{id}" not in pattern}
    return per_item, fixed


# ---- the invariants -----------------------------------------------------------------


def check_jobs(ledger: Ledger, jobs: dict[str, JobRecord]) -> list[Violation]:
    """Every accepted job is in Redis; every job in Redis ended once (no RQ result twice);
    a cancel the api confirmed held; a failure is only RQ giving up on a job whose
    workers kept dying."""
    found = []
    for seq_id, accepted in sorted(ledger.jobs.items()):
        job = jobs.get(seq_id)
        if job is None:
            found.append(Violation("lost", f"{seq_id} ({accepted.scenario}): accepted by the api, not in Redis"))
        elif accepted.cancel_confirmed and job.state != "canceled":
            found.append(Violation("cancel-not-kept", f"{seq_id}: DELETE answered canceled, yet it ended {job.state}"))
    for job in jobs.values():
        scenario = ledger.jobs[job.seq_id].scenario if job.seq_id in ledger.jobs else "not seen by a client"
        expected_results = 0 if job.state == "canceled" else 1
        if job.state not in TERMINAL:
            found.append(Violation("stuck", f"{job.seq_id} ({scenario}): still {job.state} after the drain"))
        elif job.results != expected_results:
            found.append(Violation("ended-twice" if job.results > expected_results else "no-result",
                                   f"{job.seq_id} ({scenario}): {job.state} with {job.results} RQ results"))
        if job.state == "failed" and _ABANDONED not in (job.error or ""):
            found.append(Violation("failed", f"{job.seq_id} ({scenario}): {job.error}"))
        if job.stream_ends > 1:
            found.append(Violation("ended-twice", f"{job.seq_id} ({scenario}): {job.stream_ends} end events in its stream"))
    return found


def check_idempotency(ledger: Ledger) -> list[Violation]:
    return [
        Violation("idempotency", f"Idempotency-Key {key} answered with {len(seq_ids)} seq_ids: {sorted(seq_ids)}")
        for key, seq_ids in sorted(ledger.seq_ids_by_key.items()) if len(seq_ids) != 1
    ]


def check_texts(ledger: Ledger, jobs: dict[str, JobRecord]) -> list[Violation]:
    """What each client received for a finished job is its result's text."""
    found = []
    for seq_id, accepted in sorted(ledger.jobs.items()):
        job = jobs.get(seq_id)
        if job is None or job.result is None:
            continue
        for channel, text in sorted(accepted.texts.items()):
            if text != job.result["text"]:
                found.append(Violation("text-mismatch", f"{seq_id} ({accepted.scenario}): {channel} delivered "
                                       f"{text!r}, the result is {job.result['text']!r}"))
    return found


def deterministic(job: JobRecord) -> bool:
    """Greedy or seeded, one output, no beam search: the offline engine must give the same tokens."""
    sampling = job.payload.get("sampling") or {}
    return (job.payload.get("beam") is None and sampling.get("n", 1) == 1
            and (sampling.get("temperature") == 0 or sampling.get("seed") is not None))


def check_against_offline(model: Path | str, jobs: dict[str, JobRecord]) -> tuple[int, list[Violation]]:
    """(how many finished jobs were checked, the mismatches): each deterministic finished
    job's tokens against pagedq's offline engine on the job's own prompt and sampling."""
    checked = [job for job in jobs.values() if job.state == "finished" and deterministic(job)]
    if not checked:
        return 0, []
    expected = offline_greedy(model, [{"prompt_token_ids": job.payload["prompt_token_ids"], **job.payload["sampling"]}
                                      for job in checked])
    return len(checked), [
        Violation("offline-mismatch", f"{job.seq_id}: token ids {job.result['token_ids']}, offline {tokens}")
        for job, tokens in zip(checked, expected) if job.result["token_ids"] != tokens
    ]
