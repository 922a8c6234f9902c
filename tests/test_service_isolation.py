"""No request can hurt another (issue 16), against the running service: a real redis-server,
the api under real uvicorn, two `pagedq worker` processes. A hostile or careless client's
input is its own 4xx; poison that reaches the workers anyway (written to the queue by
something other than this api) fails its own job once, never retried, while six ordinary
greedy jobs finish with the offline engine's tokens on their first attempt; one client's
bad stream cursor reaches no other client.

The workers run at most 8 sequences (max_num_seqs); the api believes 32, as a fleet with
mixed configurations would, so a request of n=9 passes the api and only a worker refuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import ResponseError
from rq import Queue, Retry
from rq.job import Job
from rq.serializers import JSONSerializer

from api.shared_round_trip import SharedRoundTrip
from api.streaming import StreamHub, StreamReader
from pagedq.redis_schema import (
    JOB_FUNCTION,
    InvalidJob,
    RequestFailed,
    announce_written,
    failure_line,
    publish_end,
    stream_key,
)
from pagedq.redis_server import RedisServer
from tests.service_helpers import (
    ApiServer,
    WorkerProcess,
    count_stream_reads,
    offline_greedy,
    service_settings,
    wait_for_worker,
    wait_until,
)

pytestmark = pytest.mark.slow
QUEUE = "isolation"
KEY_A, KEY_B, KEY_T1, KEY_T2, KEY_ADMIN = "key-a-5d1f", "key-b-9c2e", "team-key-1-77aa", "team-key-2-88bb", "admin-key-3e4f"
A, B, T1, T2, ADMIN = ({"Authorization": f"Bearer {key}"} for key in (KEY_A, KEY_B, KEY_T1, KEY_T2, KEY_ADMIN))
WORKER_MAX_NUM_SEQS = 8
BYSTANDERS = [
    {"prompt_token_ids": [5 + i, 17, 29 + 3 * i, 40 + i], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    for i in range(6)
]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir()


@pytest.fixture(scope="module")
def service(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("isolation")
    redis_server = RedisServer(tmp / "redis").start()
    settings = service_settings(
        model, redis_server.url, tmp, queue_name=QUEUE, max_num_seqs=32, job_retries=2, api_keys=[KEY_A, KEY_B],
        tenant_keys={"team": [KEY_T1, KEY_T2]}, admin_api_keys=[KEY_ADMIN], probes_require_key=True,
    )
    workers = [
        WorkerProcess(settings.with_overrides(max_num_seqs=WORKER_MAX_NUM_SEQS), tmp / f"worker-{i}.log") for i in range(2)
    ]
    api = ApiServer(settings).start()
    try:
        first = wait_for_worker(api.url, headers=ADMIN)
        wait_for_worker(api.url, name_not_in={first["name"]}, headers=ADMIN)
        yield api, Redis.from_url(redis_server.url), redis_server
    finally:
        api.stop()
        for worker in workers:
            worker.stop()
        redis_server.stop()


@pytest.fixture
def http(service):
    """An HTTP client of the api with tenant A's key."""
    api, _, _ = service
    with httpx.Client(base_url=api.url, headers=A, timeout=70) as client:
        yield client


@pytest.fixture(scope="module")
def expected(model):
    return offline_greedy(model, BYSTANDERS)


def fetch(redis: Redis, seq_id: str) -> Job:
    return Job.fetch(seq_id, connection=redis, serializer=JSONSerializer)


def submit_bystanders(http: httpx.Client) -> list[str]:
    ids = []
    for body in BYSTANDERS:
        response = http.post("/generate", json=body, timeout=10)
        assert response.status_code == 202, response.text
        ids.append(response.json()["seq_id"])
    return ids


def assert_bystanders_finished_first_time(http: httpx.Client, redis: Redis, ids: list[str], expected) -> None:
    results = [http.get(f"/result/{i}", params={"wait": 60}, timeout=70).json() for i in ids]
    assert [r["status"] for r in results] == ["finished"] * len(ids)
    assert [r["token_ids"] for r in results] == expected
    # One result each: no attempt failed and was retried.
    assert [len(fetch(redis, i).results()) for i in ids] == [1] * len(ids)


# ---- item 1: poison at the api, and poison in the queue ----------------------------------------

API_POISON = [
    ("/generate", {"prompt": "hi", "n": 2, "seed": 18446744073709551615, "max_tokens": 4}, 422, "seed"),
    ("/generate", '{"prompt": "hi", "max_tokens": 6, "min_tokens": 3, "temperature": Infinity}', 422, "temperature"),
    ("/generate", '{"prompt": "hi", "top_p": NaN}', 422, "top_p"),
    ("/generate", {"prompt": "hi", "n": 300, "max_tokens": 4}, 422, "n: 300 sequences"),
    # Past one request's share (half of this api's max_num_seqs 32): it would hold the slots everyone else needs.
    ("/generate", {"prompt": "hi", "n": 17, "max_tokens": 4}, 422,
     "n: 17 sequences at once, more than one request may hold (16 of an engine's 32"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 17}, 400, "n: 17 sequences"),
    ("/generate", {"prompt": "hi", "use_beam_search": True, "beam_width": 40, "max_tokens": 4}, 422, "beam_width"),
    ("/generate", '{"prompt": "a\\ud800b"}', 422, "prompt"),
    ("/generate", '{"prompt": "hi", "stop": ["\\udfff"]}', 422, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "n": 300}, 400, "n"),
    ("/v1/completions", '{"model": "M", "prompt": "a\\ud800b"}', 400, "prompt"),
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
     "messages.0.content"),
]


def post(http: httpx.Client, path: str, body, model_name: str) -> httpx.Response:
    if isinstance(body, str):
        content = body.replace('"M"', json.dumps(model_name))
        return http.post(path, content=content, headers={"Content-Type": "application/json"})
    if path.startswith("/v1/"):
        body = {"model": model_name, **body}
    return http.post(path, json=body)


def queue_poison(redis: Redis, seq_id: str, sampling: dict, beam: dict | None = None, prompt: str | None = "hi") -> None:
    """A job the api would refuse, written straight to the queue (an older api, a script): the worker's rules apply."""
    kwargs = {"prompt": prompt, "prompt_token_ids": [7, 8, 9], "sampling": sampling, "beam": beam, "priority": 0,
              "enqueued_at": time.time(), "stream": True}
    queue = Queue(QUEUE, connection=redis, serializer=JSONSerializer)
    queue.enqueue_job(queue.create_job(JOB_FUNCTION, kwargs=kwargs, job_id=seq_id, retry=Retry(max=2)))


QUEUE_POISON = {
    "seed-overflow": ({"n": 2, "seed": 2**64 - 1, "max_tokens": 4}, None, "hi", "seed"),
    "infinite-temperature": ({"max_tokens": 6, "min_tokens": 3, "temperature": float("inf")}, None, "hi", "temperature"),
    "n-past-the-engine": ({"n": WORKER_MAX_NUM_SEQS + 1, "max_tokens": 4}, None, "hi", "n: 9 sequences"),
    # Within the api's share (16) but past the worker's own (half of its 8).
    "n-past-a-requests-share": ({"n": WORKER_MAX_NUM_SEQS // 2 + 1, "max_tokens": 4}, None, "hi",
                                "n: 5 sequences at once, more than one request may hold (4 of an engine's 8"),
    "beams-past-the-engine": (
        {"max_tokens": 4}, {"beam_width": WORKER_MAX_NUM_SEQS + 1, "max_tokens": 4}, "hi", "beam_width"),
    "surrogate-prompt": ({"max_tokens": 4}, None, "a\ud800b", "prompt"),
}


def test_poison_is_refused_and_six_bystanders_finish_on_their_first_attempt(service, http, model, expected):
    _, redis, _ = service
    ids = submit_bystanders(http)
    for path, body, status, fragment in API_POISON:
        response = post(http, path, body, model.name)
        assert response.status_code == status, (body, response.text)
        message = response.json()["error"]["message"] if path.startswith("/v1/") else response.json()["message"]
        assert fragment in message, (body, message)
        if path.startswith("/v1/"):
            assert response.json()["error"]["param"].startswith(fragment.split(":")[0])
    # A denormal top_p (0 in float32) used to remove every token: now it keeps the most likely one.
    denormal = http.post("/generate", json={"prompt_token_ids": [5, 17], "top_p": 5e-324, "max_tokens": 4,
                                                        "ignore_eos": True}, timeout=10).json()["seq_id"]
    for seq_id, (sampling, beam, prompt, _) in QUEUE_POISON.items():
        queue_poison(redis, seq_id, sampling, beam, prompt)

    assert_bystanders_finished_first_time(http, redis, ids, expected)
    result = http.get(f"/result/{denormal}", params={"wait": 30}, timeout=40).json()
    assert result["token_ids"] == offline_greedy(model, [{"prompt_token_ids": [5, 17], "max_tokens": 4, "ignore_eos": True,
                                                          "temperature": 0}])[0]
    for seq_id, (_, _, _, field) in QUEUE_POISON.items():
        # Written without an owner: only an admin key sees them.
        assert http.get(f"/result/{seq_id}", timeout=10).status_code == 404
        result = http.get(f"/result/{seq_id}", headers=ADMIN, params={"wait": 30}, timeout=40).json()
        assert result["status"] == "failed", result
        assert result["error"].startswith(failure_line(InvalidJob)) and field in result["error"], result
        job = fetch(redis, seq_id)
        assert len(job.results()) == 1  # failed once: never retried


def test_v1_answers_400_when_a_worker_refuses_the_input(service, http, model):
    """n=9 passes this api (max_num_seqs 32) but no worker (8) can run it: the job fails on its input."""
    response = http.post("/v1/completions", json={"model": model.name, "prompt": "hi", "n": 9, "max_tokens": 2},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "n" and "9 sequences" in error["message"]


# ---- item 2: one client's stream cursor ---------------------------------------------------------


def test_a_bad_last_event_id_is_a_400_and_cuts_no_other_stream(service, http, model):
    _, redis, _ = service
    body = {"prompt_token_ids": [9, 10, 11], "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    followed = http.post("/generate", json=body, timeout=10).json()["seq_id"]
    waited = http.post("/generate", json=body, timeout=10).json()["seq_id"]

    def follow() -> list[tuple[str, str]]:
        events = []
        with http.stream("GET", f"/stream/{followed}", timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("event: "):
                    events.append(line.removeprefix("event: "))
        return events

    with ThreadPoolExecutor(2) as pool:
        stream = pool.submit(follow)
        result = pool.submit(lambda: http.get(f"/result/{waited}", params={"wait": 60}, timeout=70))
        wait_until(lambda: redis.xlen(stream_key(followed)) > 3, 30, "the followed job to stream")
        for bad in ("1-99999999999999999999999", "18446744073709551616-0", "1-x", "abc"):
            response = http.get(f"/stream/{followed}", headers={"Last-Event-ID": bad}, timeout=10)
            assert response.status_code == 400 and "Last-Event-ID" in response.json()["message"], response.text
        events = stream.result(timeout=90)
        assert result.result(timeout=90).status_code == 200
    assert events[-1] == "end" and events.count("delta") >= 1
    assert http.get(f"/result/{followed}", timeout=10).json()["status"] == "finished"
    # The largest id Redis takes is accepted (and the stream is replayed after it: nothing).
    response = http.get(f"/stream/{followed}", headers={"Last-Event-ID": f"{2**64 - 1}-{2**64 - 1}"}, timeout=10)
    assert response.status_code == 200


def test_the_stream_hub_gives_a_refused_read_only_to_its_own_followers(service):
    """Past the api's check, should Redis still refuse one stream's cursor, that stream's followers alone hear of it."""
    _, _, redis_server = service

    async def run() -> tuple[object, list]:
        connection = AsyncRedis.from_url(redis_server.url)
        hub = StreamHub(connection, block_s=0.2)
        try:
            async with hub.follow("good", "0-0") as good, hub.follow("bad", "1-99999999999999999999999") as bad:
                await connection.xadd(stream_key("good"), {"type": "delta", "text": "x"})
                refused = await asyncio.wait_for(bad.get(), 10)
                await connection.xadd(stream_key("good"), {"type": "delta", "text": "y"})
                batches = [await asyncio.wait_for(good.get(), 10)]
                while sum(map(len, batches)) < 2:
                    batches.append(await asyncio.wait_for(good.get(), 10))
                return refused, batches
        finally:
            await hub.close()
            await connection.aclose()

    refused, batches = asyncio.run(run())
    assert isinstance(refused, ResponseError)
    assert [fields["text"] for batch in batches for _, fields in batch] == ["x", "y"]


def test_a_follower_joining_behind_the_hubs_read_misses_nothing(service):
    """A client resuming a stream from an earlier entry (Last-Event-ID), or a second viewer
    of a job from its start, joins while the hub's read of that stream is out from where its
    other follower stands: the read's entries must not carry the newcomer past what lies
    between its cursor and that read's."""
    _, _, redis_server = service

    async def run() -> list[str]:
        connection = AsyncRedis.from_url(redis_server.url)
        writer = Redis.from_url(redis_server.url)
        hub = StreamHub(connection, block_s=30)
        key = stream_key("joined-behind")
        try:
            first_id = writer.xadd(key, {"type": "delta", "text": "a"}).decode()
            writer.xadd(key, {"type": "delta", "text": "b"})
            async with hub.follow("joined-behind", "0-0") as ahead:
                assert len(await asyncio.wait_for(ahead.get(), 10)) == 2
                await asyncio.sleep(0.2)  # the hub is blocked in its read after "b"
                # Written while the loop cannot run: the read's reply ("c") waits for the hub
                # task, which runs only once the newcomer has joined.
                writer.xadd(key, {"type": "delta", "text": "c"})
                async with hub.follow("joined-behind", first_id) as behind:
                    texts: list[str] = []
                    while len(texts) < 2:
                        batch = await asyncio.wait_for(behind.get(), 10)
                        assert isinstance(batch, list), f"after {texts}: {batch!r}"
                        texts += [fields["text"] for _, fields in batch]
                    return texts
        finally:
            await hub.close()
            await connection.aclose()
            writer.close()

    assert asyncio.run(run()) == ["b", "c"]


def test_streams_opened_in_a_burst_join_the_hubs_read_at_once_on_few_wakes(service):
    """A follower joining while the hub's read is blocked makes it read again at once (well
    inside its 30 s block), also when the wake lands while a read is being sent; fifty
    followers joining together send a wake or two, not fifty (each wake is a round trip and
    a re-read of every stream followed)."""
    _, _, redis_server = service

    async def run() -> tuple[list, int, float]:
        connection = AsyncRedis.from_url(redis_server.url)
        hub = StreamHub(connection, block_s=30)
        try:
            async with hub.follow("burst-first", "0-0"):
                await asyncio.sleep(0.2)  # the hub is blocked in its read of the first stream
                started = time.monotonic()
                async with contextlib.AsyncExitStack() as stack:
                    queues = await asyncio.gather(
                        *(stack.enter_async_context(hub.follow(f"burst-{i}", "0-0")) for i in range(50))
                    )
                    for i in range(50):
                        async with connection.pipeline(transaction=False) as pipeline:
                            pipeline.xadd(stream_key(f"burst-{i}"), {"type": "delta", "text": str(i)})
                            announce_written(pipeline, [stream_key(f"burst-{i}")])
                            await pipeline.execute()
                    batches = await asyncio.wait_for(asyncio.gather(*(queue.get() for queue in queues)), 10)
                    took = time.monotonic() - started
                wakes = (await connection.xinfo_stream(hub._wake_key))["entries-added"]
                return batches, wakes, took
        finally:
            await hub.close()
            await connection.aclose()

    batches, wakes, took = asyncio.run(run())
    assert [batch[0][1]["text"] for batch in batches] == [str(i) for i in range(50)]
    assert took < 5 and 1 <= wakes <= 3


def test_the_stream_hub_reads_the_streams_announced_written_and_every_stream_each_block(service):
    """Between its reads of every stream followed (each block_s), the hub reads only those
    whose writes were announced (redis_schema.WRITTEN_KEY): a busy stream among a hundred
    quiet ones costs reads of one stream, not of a hundred and one. A write never announced
    is relayed all the same, by the next read of every stream."""
    _, _, redis_server = service

    async def run() -> tuple[list[str], list[str], list[int]]:
        connection = AsyncRedis.from_url(redis_server.url)
        hub = StreamHub(connection, block_s=5.0)
        read_sizes = count_stream_reads(connection)
        try:
            async with contextlib.AsyncExitStack() as stack:
                for i in range(100):
                    await stack.enter_async_context(hub.follow(f"quiet-{i}", "0-0"))
                busy = await stack.enter_async_context(hub.follow("busy", "0-0"))
                unannounced = await stack.enter_async_context(hub.follow("unannounced", "0-0"))
                await asyncio.sleep(0.3)  # past the first read of every stream
                read_sizes.clear()
                texts = []
                for i in range(20):
                    async with connection.pipeline(transaction=False) as pipeline:
                        pipeline.xadd(stream_key("busy"), {"type": "delta", "text": str(i)})
                        announce_written(pipeline, [stream_key("busy")])
                        await pipeline.execute()
                    texts += [fields["text"] for _, fields in await asyncio.wait_for(busy.get(), 1.0)]
                busy_reads = list(read_sizes)
                await connection.xadd(stream_key("unannounced"), {"type": "delta", "text": "late"})
                late = [fields["text"] for _, fields in await asyncio.wait_for(unannounced.get(), 10)]
                return texts, late, busy_reads
        finally:
            await hub.close()
            await connection.aclose()

    texts, late, busy_reads = asyncio.run(run())
    assert texts == [str(i) for i in range(20)]
    assert late == ["late"]
    # The busy stream alone in each read; all 102 only should the read of every stream
    # (each 5 s) fall inside the writes.
    assert busy_reads and sum(size > 1 for size in busy_reads) <= 1, busy_reads


def test_a_long_poll_wakes_on_its_own_jobs_end_and_finds_an_end_without_one_by_status(service):
    """GET /result?wait= waiters follow the stream of every job's end, not their jobs' tokens:
    each wakes on its own job's end (not a bystander's, whose end comes first), at once
    though its status check is 60 s away; a job that ends with no "end" written (its worker
    died, RQ failed it) is found by the status check."""
    _, _, redis_server = service
    sync = Redis.from_url(redis_server.url)

    def start(seq_id: str) -> None:
        sync.hset(Job.key_for(seq_id), mapping={"status": "started"})

    def end(seq_id: str, write_end: bool = True) -> None:
        with sync.pipeline() as pipeline:
            pipeline.hset(Job.key_for(seq_id), "status", "finished")
            if write_end:
                publish_end(pipeline, seq_id, "finished", 60)
            pipeline.execute()

    async def run(poll_s: float, seq_ids: list[str], ends: list[tuple[str, bool]]) -> dict[str, float]:
        connection = AsyncRedis.from_url(redis_server.url)
        reader = StreamReader(connection, SharedRoundTrip(connection), poll_s=poll_s)
        woken: dict[str, float] = {}

        async def wait(seq_id: str) -> None:
            await reader.wait_until_done(seq_id, 120)
            woken[seq_id] = time.monotonic()

        try:
            waiters = [asyncio.create_task(wait(seq_id)) for seq_id in seq_ids]
            await asyncio.sleep(0.5)
            for seq_id, write_end in ends:
                end(seq_id, write_end)
                await asyncio.sleep(1.0)
                woken[f"{seq_id} ended"] = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*waiters), 30)
            return woken
        finally:
            await reader.hub.close()
            await connection.aclose()

    for seq_id in ("poll-a", "poll-b", "poll-c"):
        start(seq_id)
    woken = asyncio.run(run(60, ["poll-a", "poll-b"], [("poll-b", True), ("poll-a", True)]))
    assert woken["poll-b"] < woken["poll-b ended"] < woken["poll-a"] < woken["poll-a ended"]
    # No "end" written: the status check (every poll_s) finds it.
    woken = asyncio.run(run(0.3, ["poll-c"], [("poll-c", False)]))
    assert woken["poll-c"] < woken["poll-c ended"]


def test_a_long_polls_status_checks_back_off_to_a_cap(tmp_path):
    """A waiting long poll's job is checked for an end with no "end" written after poll_s,
    then at intervals doubling up to end_check_max_s: a few reads over a long wait, not one
    every poll_s (a few hundred waiting polls' checks were ~7% of the api's CPU), and a job
    that ends with no "end" written long into the wait is still found within the cap."""
    server = RedisServer(tmp_path).start()
    sync = Redis.from_url(server.url)

    def status_reads() -> int:
        return sync.info("commandstats").get("cmdstat_hget", {}).get("calls", 0)

    async def run() -> tuple[int, float]:
        connection = AsyncRedis.from_url(server.url)
        reader = StreamReader(connection, SharedRoundTrip(connection), poll_s=0.05, end_check_max_s=0.5)
        try:
            waiter = asyncio.create_task(reader.wait_until_done("long", 60))
            # Checks due 0.05, 0.15, 0.35 s into the wait, then every 0.5 s (0.75, 1.25, ...).
            await asyncio.sleep(0.5)
            before = status_reads()
            await asyncio.sleep(3.0)
            reads = status_reads() - before
            sync.hset(Job.key_for("long"), "status", "finished")  # and no "end" written
            ended = time.monotonic()
            await asyncio.wait_for(waiter, 10)
            return reads, time.monotonic() - ended
        finally:
            await reader.hub.close()
            await connection.aclose()

    try:
        sync.hset(Job.key_for("long"), mapping={"status": "started"})
        reads, woken_after = asyncio.run(run())
    finally:
        server.stop()
    # Six checks in those 3 s at the cap; sixty at every poll_s; three doubling without a cap.
    assert 4 <= reads <= 10, reads
    # Without the cap the next check would come ~2.9 s after the end.
    assert woken_after < 1.5, woken_after


# ---- item 4: 500s that were the client's input ---------------------------------------------------


def test_a_surrogate_or_deep_nesting_in_a_batch_line_fails_that_line_and_batch_keys_are_not_ids(service, http, model):
    lines = [
        {"custom_id": "fine", "method": "POST", "url": "/v1/completions",
         "body": {"model": model.name, "prompt": [5, 6, 7], "max_tokens": 3}},
        {"custom_id": "surrogate", "method": "POST", "url": "/v1/completions",
         "body": {"model": model.name, "prompt": "a\ud800b", "max_tokens": 3}},
    ]
    # Nested 10,000 deep: once a RecursionError that failed the whole batch.
    content = "\n".join([*(json.dumps(line) for line in lines), "[" * 10000 + "]" * 10000]).encode()
    upload = http.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}, timeout=30)
    batch = http.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                                                       "completion_window": "24h"}, timeout=60).json()
    assert batch["status"] == "in_progress", batch
    done = wait_until(lambda: (b := http.get(f"/v1/batches/{batch['id']}", timeout=30).json())["status"]
                      == "completed" and b, 60, "the batch to complete")
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    errors = [json.loads(line) for line in http.get(f"/v1/files/{done['error_file_id']}/content").text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["surrogate", None]
    assert errors[0]["response"]["status_code"] == 400 and "surrogate" in errors[0]["response"]["body"]["error"]["message"]
    assert errors[1]["error"]["code"] == "invalid_json" and "nested" in errors[1]["error"]["message"]
    for suffix in (":lines", ":outcomes", ":errors", ":lease"):
        assert http.get(f"/v1/batches/{batch['id']}{suffix}", timeout=10).status_code == 404
        assert http.post(f"/v1/batches/{batch['id']}{suffix}/cancel", timeout=10).status_code == 404


# ---- item 5: tenancy ------------------------------------------------------------------------------


def test_two_keys_cannot_touch_each_others_jobs_files_or_batches(service, model):
    api, _, _ = service
    with httpx.Client(base_url=api.url, timeout=60) as http:
        job = http.post("/generate", headers=A, json={"prompt": "hi", "max_tokens": 300, "ignore_eos": True}).json()["seq_id"]
        for headers in (B, T1):
            assert http.get(f"/result/{job}", headers=headers).status_code == 404
            assert http.get(f"/result/{job}", headers=headers, params={"wait": 5}).status_code == 404
            assert http.get(f"/stream/{job}", headers=headers).status_code == 404
            assert http.delete(f"/result/{job}", headers=headers).status_code == 404
        assert http.get(f"/result/{job}", headers=ADMIN).status_code == 200
        assert http.delete(f"/result/{job}", headers=A).json()["status"] == "canceled"  # B's cancel did nothing

        # A named tenant's keys share its work; other keys see none of it.
        team_job = http.post("/generate", headers=T1, json={"prompt": "hi", "max_tokens": 2}).json()["seq_id"]
        assert http.get(f"/result/{team_job}", headers=T2, params={"wait": 30}).json()["status"] == "finished"
        assert http.get(f"/result/{team_job}", headers=A).status_code == 404
        # The same Idempotency-Key from two tenants names two jobs.
        ids = {http.post("/generate", headers={**h, "Idempotency-Key": "k1"}, json={"prompt": "hi", "max_tokens": 2}).json()["seq_id"]
               for h in (A, B)}
        assert len(ids) == 2

        line = {"custom_id": "one", "method": "POST", "url": "/v1/completions",
                "body": {"model": model.name, "prompt": [5, 6], "max_tokens": 2}}
        upload = http.post("/v1/files", headers=A, files={"file": ("in.jsonl", json.dumps(line).encode())},
                           data={"purpose": "batch"}).json()
        for request in (("GET", f"/v1/files/{upload['id']}"), ("GET", f"/v1/files/{upload['id']}/content"),
                        ("DELETE", f"/v1/files/{upload['id']}")):
            assert http.request(*request, headers=B).status_code == 404, request
        create = {"input_file_id": upload["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        assert http.post("/v1/batches", headers=B, json=create).status_code == 404  # B cannot run A's file
        batch = http.post("/v1/batches", headers=A, json=create).json()
        assert http.get(f"/v1/batches/{batch['id']}", headers=B).status_code == 404
        assert http.post(f"/v1/batches/{batch['id']}/cancel", headers=B).status_code == 404
        assert http.get(f"/result/{batch['id']}-0", headers=B).status_code == 404  # its line's job
        assert batch["id"] not in [b["id"] for b in http.get("/v1/batches", headers=B).json()["data"]]
        assert batch["id"] in [b["id"] for b in http.get("/v1/batches", headers=A).json()["data"]]
        assert batch["id"] in [b["id"] for b in http.get("/v1/batches", headers=ADMIN).json()["data"]]
        done = wait_until(lambda: (b := http.get(f"/v1/batches/{batch['id']}", headers=A).json())["status"] == "completed" and b,
                          60, "the batch to complete")
        assert http.get(f"/v1/files/{done['output_file_id']}/content", headers=B).status_code == 404
        assert http.get(f"/v1/files/{done['output_file_id']}/content", headers=A).status_code == 200
        assert http.get(f"/v1/files/{upload['id']}", headers=A).status_code == 200  # B's delete did nothing
        # GET /v1/files lists the caller's own files only (the admin's: everyone's).
        listed = {h["Authorization"]: {f["id"] for f in http.get("/v1/files", headers=h).json()["data"]} for h in (A, B, ADMIN)}
        assert {upload["id"], done["output_file_id"]} <= listed[A["Authorization"]] <= listed[ADMIN["Authorization"]]
        assert not listed[B["Authorization"]] & listed[A["Authorization"]]

        # A file-list cursor is the caller's own file or nothing: A's id, as B's cursor, answers
        # as an unknown id (B has an older file it would list after A's otherwise).
        http.post("/v1/files", headers=B, files={"file": ("b.jsonl", json.dumps(line).encode())}, data={"purpose": "batch"})
        newer = http.post("/v1/files", headers=A, files={"file": ("a.jsonl", b"{}")}, data={"purpose": "batch"}).json()
        unknown = http.get("/v1/files", headers=B, params={"after": "file-0000000000000000"}).json()
        assert http.get("/v1/files", headers=B, params={"after": newer["id"]}).json() == unknown
        assert unknown["data"] == [] and http.get("/v1/files", headers=B).json()["data"]

        # Probes need a key here (PAGEDQ_PROBES_REQUIRE_KEY); liveness never does. Their counts
        # span every tenant: a tenant key hears only that the service is ready.
        assert http.get("/metrics").status_code == 401 and http.get("/ready").status_code == 401
        assert http.get("/metrics", headers=B).status_code == 403
        assert http.get("/ready", headers=B).json() == {"status": "ready"}
        assert http.get("/metrics", headers=ADMIN).status_code == 200
        assert {"queue_depth", "workers"} <= set(http.get("/ready", headers=ADMIN).json())
        assert http.get("/health").status_code == 200


def test_no_key_reaches_a_log_however_it_is_sent(service, caplog):
    api, _, _ = service
    caplog.set_level(logging.DEBUG)
    with httpx.Client(base_url=api.url, timeout=10) as http:
        assert http.get("/result/abc", params={"api_key": KEY_A}).status_code == 401
        assert http.get(f"/result/abc?key={KEY_B}&wait=1").status_code == 401
        assert http.get("/result/abc", headers={"Authorization": f"Basic {KEY_T1}"}).status_code == 401
        assert http.get("/result/abc", headers={"X-Api-Key": KEY_T2}).status_code == 401
        assert http.get(f"/result/{KEY_ADMIN}", headers=A).status_code == 404  # a key pasted where an id goes
        assert http.post("/generate", headers=A, json={"prompt": KEY_B, "bogus": 1}).status_code == 422
    # What the api process logs (the test's own HTTP client logs its URLs too: not the api's).
    server = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith(("uvicorn", "pagedq", "api", "rq")))
    assert "GET /result/abc" in server  # the access log was captured
    for key in (KEY_A, KEY_B, KEY_T1, KEY_T2, KEY_ADMIN):
        assert key not in server


# ---- worker-side isolation: a request the engine fails alone -----------------------------------


def test_a_job_the_engine_fails_alone_fails_once_and_the_others_finish(service, model, expected, tmp_path):
    """The batch worker's own loop (in this process, so a fault can be injected into its
    real engine: nothing that passes the input rules is known to throw any more). The
    poison's job fails once with the engine's error, never retried, while the bystanders
    of the same steps finish with the offline tokens on their first attempt."""
    from pagedq.front.llm_engine import LLMEngine
    from worker.rq.batch_worker import BatchWorker
    from worker.rq.engine_factory import build_engine

    api, redis, redis_server = service
    # core_process=False: the fault goes into the engine core, which must be in this process to be reached.
    settings = service_settings(model, redis_server.url, tmp_path, queue_name="isolation-inproc", job_retries=2,
                                core_process=False)
    threads = torch.get_num_threads()
    engine: LLMEngine = build_engine(settings)  # with the workers' one thread, as `expected` was made
    sample = engine.runner.sample

    def poisoned(logits, rows):
        if any(seq.request.prompt_token_ids == [66, 67, 68] for seq in rows):
            raise FloatingPointError("poison")
        return sample(logits, rows)

    engine.runner.sample = poisoned
    queue = Queue("isolation-inproc", connection=redis, serializer=JSONSerializer)

    def enqueue(seq_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        kwargs = {"prompt": None, "prompt_token_ids": prompt_token_ids, "sampling": sampling, "beam": None, "priority": 0,
                  "enqueued_at": time.time(), "stream": True}
        queue.enqueue_job(queue.create_job(JOB_FUNCTION, kwargs=kwargs, job_id=seq_id, retry=Retry(max=2)))

    for i, body in enumerate(BYSTANDERS):
        enqueue(f"inproc-ok-{i}", body["prompt_token_ids"], body["max_tokens"])
    enqueue("inproc-poison", [66, 67, 68], 8)
    worker = BatchWorker(engine, settings, Redis.from_url(redis_server.url))
    worker.bootstrap()
    try:
        ids = [f"inproc-ok-{i}" for i in range(len(BYSTANDERS))] + ["inproc-poison"]
        deadline = time.monotonic() + 60
        while any(fetch(redis, i).get_status() not in ("finished", "failed") for i in ids):
            assert time.monotonic() < deadline, "the jobs did not end"
            worker._tick()
    finally:
        worker.teardown()
        torch.set_num_threads(threads)
    poison = fetch(redis, "inproc-poison")
    assert poison.get_status() == "failed" and len(poison.results()) == 1
    assert poison.latest_result().exc_string.strip().splitlines()[-1].startswith(failure_line(RequestFailed))
    assert "sampling failed: FloatingPointError('poison')" in poison.latest_result().exc_string
    jobs = [fetch(redis, f"inproc-ok-{i}") for i in range(len(BYSTANDERS))]
    assert [job.return_value()["token_ids"] for job in jobs] == expected
    assert [len(job.results()) for job in jobs] == [1] * len(BYSTANDERS)
