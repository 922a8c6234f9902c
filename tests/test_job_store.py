"""JobStore.read(): a job and its latest result read on the event loop in one round trip,
restored by RQ's own parsers, say what RQ's blocking reads say (GET /result's and the
OpenAI routes' answers come from it), and another tenant's job is as absent as none."""

from __future__ import annotations

import asyncio

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from api.auth import ANYONE, Caller
from api.jobs import ENQUEUE_SCRIPT, JobStore
from api.shared_round_trip import SharedRoundTrip
from pagedq.protocol import GenerateRequest, GenerationResult, Timings, Usage
from tests.service_helpers import service_settings


def _ended_job(store: JobStore, owner: str, status: JobStatus, result: GenerationResult | None = None) -> Job:
    """A job queued as the api queues it, then given `status` and the result a worker records with it."""
    request = GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=2)
    prepared = store.prepare(request, [1, 2, 3], None, owner)
    store.connection.eval(ENQUEUE_SCRIPT, len(prepared.keys), *prepared.keys, *prepared.args)
    job = Job.fetch(prepared.seq_id, connection=store.connection, serializer=JSONSerializer)
    job.set_status(status)
    if result is not None:
        Result.create(job, Result.Type.SUCCESSFUL, ttl=600, return_value=result.model_dump(mode="json"))
    elif status == JobStatus.FAILED:
        Result.create_failure(job, ttl=600, exc_string="Traceback (most recent call last):\nValueError: it broke\n")
    return job


def test_a_job_read_on_the_loop_says_what_rqs_blocking_reads_say(redis_server, tmp_path):
    store = JobStore(Redis.from_url(redis_server.url), service_settings("unused-model", redis_server.url, tmp_path,
                                                                       queue_name="read"))
    result = GenerationResult(seq_id="x", prompt=None, text="hi", token_ids=[5, 6], finish_reason="length",
                              usage=Usage(prompt_tokens=3, completion_tokens=2), timings=Timings())
    finished = _ended_job(store, "alice", JobStatus.FINISHED, result)
    failed = _ended_job(store, "alice", JobStatus.FAILED)
    queued = _ended_job(store, "alice", JobStatus.QUEUED)

    async def read_all() -> list:
        connection = AsyncRedis.from_url(redis_server.url)
        round_trip = SharedRoundTrip(connection)
        try:
            return [await store.read(round_trip, job.id, Caller("alice")) for job in (finished, failed, queued)] + [
                await store.read(round_trip, finished.id, Caller("mallory")),
                await store.read(round_trip, "no-such-job", ANYONE),
                await store.outcome(round_trip, failed.id),
            ]
        finally:
            await connection.aclose()

    *stored, others, missing, outcome = asyncio.run(read_all())
    for job, read in zip((finished, failed, queued), stored):
        fetched = Job.fetch(job.id, connection=store.connection, serializer=JSONSerializer)
        assert read.job.id == job.id and read.job.meta == fetched.meta
        # The same answers as from the blocking reads (Job.fetch, then its latest result when asked).
        assert store.outcome_of(read) == store.job_outcome(fetched)
    assert store.outcome_of(stored[0]) == ("finished", result, None)
    assert outcome == ("failed", None, "ValueError: it broke")
    assert store.snapshot_of(stored[0]) == store.snapshot(finished.id, Caller("alice"))
    assert store.snapshot_of(stored[0]).text == "hi"
    assert others is None and missing is None
