"""api.shared_round_trip: calls made at once (submissions, job reads) share a Redis round
trip, each keeps its own commands' replies (a submission its own script call: its answer,
its place in the queue), and one Redis refuses fails alone."""

from __future__ import annotations

import asyncio

import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from rq import Queue

from api.jobs import JobStore, QueueFull
from api.shared_round_trip import SharedRoundTrip
from pagedq.protocol import GenerateRequest
from tests.service_helpers import service_settings


def _store(redis_server, tmp_path, queue_name: str, **overrides) -> JobStore:
    settings = service_settings("unused-model", redis_server.url, tmp_path, queue_name=queue_name, **overrides)
    return JobStore(Redis.from_url(redis_server.url), settings)


def _prepared(store: JobStore, count: int):
    request = GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=2)
    return [store.prepare(request, [1, 2, 3], None, "tenant") for _ in range(count)]


async def _with_pipelines_counted(redis_server, use):
    """`await use(round_trip, pipelines)`: a SharedRoundTrip whose every pipeline is counted in `pipelines`."""
    connection = AsyncRedis.from_url(redis_server.url)
    pipelines = []
    pipeline = connection.pipeline
    connection.pipeline = lambda *args, **kwargs: pipelines.append(1) or pipeline(*args, **kwargs)
    try:
        return await use(SharedRoundTrip(connection), pipelines)
    finally:
        await connection.aclose()


async def _enqueue_counting_round_trips(redis_server, jobs) -> tuple[list, int]:
    async def enqueue(round_trip: SharedRoundTrip, pipelines: list) -> tuple[list, int]:
        outcomes = await asyncio.gather(*(JobStore.enqueue(round_trip, job) for job in jobs), return_exceptions=True)
        return outcomes, len(pipelines)

    return await _with_pipelines_counted(redis_server, enqueue)


def test_a_burst_shares_round_trips_and_each_keeps_its_answer_and_place(redis_server, tmp_path):
    store = _store(redis_server, tmp_path, "burst", max_queue_depth=5)
    jobs = _prepared(store, 8)
    outcomes, round_trips = asyncio.run(_enqueue_counting_round_trips(redis_server, jobs))
    # One script call each, in arrival order: the depth limit stops exactly the last three.
    assert outcomes == [1] * 5 + [-1] * 3
    assert round_trips <= 2  # the first alone at most, then everything that arrived meanwhile
    assert Queue("burst", connection=store.connection).job_ids == [job.seq_id for job in jobs[:5]]
    assert [store.settle(job, 1) for job in jobs[:5]] == ["queued"] * 5
    with pytest.raises(QueueFull):
        store.settle(jobs[5], outcomes[5])


def test_reads_made_at_once_share_the_round_trip_and_each_gets_its_own_replies(redis_server, tmp_path):
    """Stream openings (one command) and GET /result reads (two) of a burst, with a
    submission among them: one pipeline, on one connection, each caller its own replies."""
    store = _store(redis_server, tmp_path, "reads")
    (job,) = _prepared(store, 1)
    sync = Redis.from_url(redis_server.url)
    sync.hset("reads:a", mapping={"status": "started", "meta": "{}"})
    sync.hset("reads:b", mapping={"status": "finished"})

    async def read(round_trip: SharedRoundTrip, pipelines: list) -> tuple[list, int]:
        await round_trip.call(lambda p: p.ping())  # the first call goes alone: the burst shares the next
        pipelines.clear()
        replies = await asyncio.gather(
            round_trip.call(lambda p: p.hmget("reads:a", "status", "meta")),
            round_trip.call(lambda p: (p.hgetall("reads:b"), p.exists("reads:none"))),
            JobStore.enqueue(round_trip, job),
            round_trip.call(lambda p: p.hget("reads:none", "status")),
        )
        return replies, len(pipelines)

    replies, round_trips = asyncio.run(_with_pipelines_counted(redis_server, read))
    assert replies == [[[b"started", b"{}"]], [{b"status": b"finished"}, 0], 1, [None]]
    assert round_trips == 1
    assert Queue("reads", connection=store.connection).job_ids == [job.seq_id]


def test_a_call_redis_refuses_fails_that_submission_alone(redis_server, tmp_path):
    good = _store(redis_server, tmp_path, "fine")
    broken = _store(redis_server, tmp_path, "broken")
    # The queue's key holds a string: the script's LLEN on it is refused, for that call only.
    broken.connection.set(broken.queue.key, "not a list")
    jobs = [*_prepared(good, 2), *_prepared(broken, 1), *_prepared(good, 2)]
    outcomes, _ = asyncio.run(_enqueue_counting_round_trips(redis_server, jobs))
    assert outcomes[:2] == [1, 1] and outcomes[3:] == [1, 1]
    assert isinstance(outcomes[2], ResponseError)
    assert Queue("fine", connection=good.connection).count == 4


def test_a_waiter_that_goes_away_leaves_the_others_their_answers(redis_server, tmp_path):
    store = _store(redis_server, tmp_path, "cancel")
    jobs = _prepared(store, 4)

    async def run() -> list:
        connection = AsyncRedis.from_url(redis_server.url)
        try:
            round_trip = SharedRoundTrip(connection)
            tasks = [asyncio.create_task(JobStore.enqueue(round_trip, job)) for job in jobs]
            await asyncio.sleep(0)
            tasks[1].cancel()  # its client disconnected while the round trip was out
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await connection.aclose()

    outcomes = asyncio.run(run())
    assert isinstance(outcomes[1], asyncio.CancelledError)
    assert [outcomes[0], *outcomes[2:]] == [1, 1, 1]


def test_a_round_trip_torn_down_under_it_answers_as_redis_being_away(redis_server, tmp_path):
    """Redis restarting under the api: uvloop's closed transport raises RuntimeError, which
    redis-py does not wrap (the chaos soak met it as a 500). Every submission in that round
    trip hears Redis' ConnectionError instead: the api's 503, retry later."""
    jobs = _prepared(_store(redis_server, tmp_path, "torn"), 3)

    async def run() -> list:
        connection = AsyncRedis.from_url(redis_server.url)
        pipeline = connection.pipeline

        def torn_down(*args, **kwargs):
            made = pipeline(*args, **kwargs)

            async def execute(**_):
                raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

            made.execute = execute
            return made

        connection.pipeline = torn_down
        try:
            round_trip = SharedRoundTrip(connection)
            return await asyncio.gather(*(JobStore.enqueue(round_trip, job) for job in jobs), return_exceptions=True)
        finally:
            await connection.aclose()

    outcomes = asyncio.run(run())
    assert all(isinstance(outcome, RedisConnectionError) for outcome in outcomes), outcomes
