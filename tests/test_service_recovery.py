"""Failures with real processes and real signals: a worker SIGKILLed with jobs in flight,
Redis restarted (AOF on) under a running worker, SIGTERM draining, a worker stopped while
its engine loads and an api while it starts, and several workers sharing one queue. Every
job must finish exactly once, with the offline engine's tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.suspension import resume, suspend
from rq.utils import as_text

from pagedq.client import Client
from pagedq.redis_server import RedisServer
from tests.service_helpers import (
    ApiServer,
    WorkerProcess,
    offline_greedy,
    processes_below,
    ready_workers,
    service_settings,
    suspend_workers,
    wait_for_worker,
    wait_until,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    # Room for jobs long enough that a fast engine cannot finish them within a drain.
    return tiny_model_dir(max_position_embeddings=4096)


@pytest.fixture
def service(model, tmp_path):
    """Redis and the api; each test starts (and kills) its own workers."""
    redis_server = RedisServer(tmp_path / "redis").start()
    settings = service_settings(model, redis_server.url, tmp_path)
    api = ApiServer(settings).start()
    workers: list[WorkerProcess] = []

    def start_worker(**overrides) -> WorkerProcess:
        worker = WorkerProcess(settings.with_overrides(**overrides), tmp_path / f"worker-{len(workers)}.log")
        workers.append(worker)
        return worker

    try:
        with Client(api.url, timeout_s=60) as client:
            yield client, redis_server, start_worker, api
    finally:
        api.stop()
        for worker in workers:
            worker.stop()
        redis_server.stop()


def long_requests(count: int, max_tokens: int) -> list[dict]:
    return [
        {"prompt_token_ids": [7 + (i * 13 + j) % 400 for j in range(4 + i % 5)], "max_tokens": max_tokens,
         "ignore_eos": True, "temperature": 0}
        for i in range(count)
    ]


def jobs(redis: Redis, seq_ids: list[str]) -> list[Job]:
    return Job.fetch_many(seq_ids, connection=redis, serializer=JSONSerializer)


def assert_finished_once(client: Client, redis: Redis, seq_ids: list[str], expected: list[list[int]]) -> None:
    results = [client.result(seq_id) for seq_id in seq_ids]
    assert [r["status"] for r in results] == ["finished"] * len(seq_ids)
    assert [r["token_ids"] for r in results] == expected
    # Exactly one result recorded per job: no attempt finished twice.
    assert [len(job.results()) for job in jobs(redis, seq_ids)] == [1] * len(seq_ids)


def test_sigkilled_worker_jobs_finish_on_another_worker(service, model):
    client, redis_server, start_worker, api = service
    redis = Redis.from_url(redis_server.url)
    doomed = start_worker()
    first = wait_for_worker(api.url)["name"]
    requests = long_requests(20, max_tokens=1000)  # none ends before the SIGKILL, even on a loaded machine
    seq_ids = [client.submit(**body)["seq_id"] for body in requests]
    # All 20 in flight on the first worker, generating.
    wait_until(
        lambda: all(job.get_status(refresh=False) == "started" and job.worker_name == first
                    for job in jobs(redis, seq_ids)),
        30, "all 20 jobs to start",
    )
    wait_until(lambda: len(client.result(seq_ids[-1])["token_ids"]) > 0, 30, "tokens")

    doomed.process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    doomed.process.wait()
    start_worker()
    wait_until(lambda: all(client.result(s)["status"] == "finished" for s in seq_ids), 60, "all 20 to finish")
    assert time.monotonic() - killed_at < 60
    assert_finished_once(client, redis, seq_ids, offline_greedy(model, requests))
    # The stream says the first attempt was dropped and carries the second one whole.
    events = list(client.events(seq_ids[0]))
    reset = max(i for i, (event, _) in enumerate(events) if event == "reset")
    assert events[reset][1] == {"attempt": 2}
    again = "".join(data["text"] for event, data in events[reset:] if event == "delta")
    assert again == client.result(seq_ids[0])["text"]


def test_redis_restart_keeps_queued_jobs_and_the_worker_resumes(service, model):
    client, redis_server, start_worker, api = service
    redis = Redis.from_url(redis_server.url)
    worker = start_worker()
    wait_for_worker(api.url)
    requests = long_requests(7, max_tokens=300)
    running = [client.submit(**body)["seq_id"] for body in requests[:2]]
    wait_until(lambda: all(len(client.result(s)["token_ids"]) > 0 for s in running), 30, "two jobs running")
    suspend_workers(redis, api.url)  # the next jobs stay queued
    queued = [client.submit(**body)["seq_id"] for body in requests[2:]]

    redis_server.stop()  # SIGTERM: the AOF is flushed
    time.sleep(2.0)
    assert worker.process.poll() is None  # retrying, not dead
    redis_server.start()  # same port, same data directory
    assert [client.result(s)["status"] for s in queued] == ["queued"] * 5
    resume(redis)
    wait_until(lambda: all(client.result(s)["status"] == "finished" for s in running + queued), 60, "all to finish")
    assert_finished_once(client, redis, running + queued, offline_greedy(model, requests))
    assert "Redis is unreachable" in worker.log()
    assert worker.process.poll() is None and len(ready_workers(api.url)) == 1


def test_redis_out_of_memory_pauses_the_service_and_loses_nothing(service, model):
    """Redis refusing writes (maxmemory under noeviction) while jobs run: the worker waits
    it out holding its jobs, the api answers 503 naming the cause (and keeps the client's
    connection), a stream opened meanwhile carries on to its end, /ready says why; once
    memory is freed every job finishes once, with the offline engine's tokens."""
    client, redis_server, start_worker, api = service
    redis = Redis.from_url(redis_server.url)
    worker = start_worker()
    worker_name = wait_for_worker(api.url)["name"]
    requests = long_requests(6, max_tokens=300)
    seq_ids = [client.submit(**body)["seq_id"] for body in requests]
    wait_until(lambda: all(len(client.result(s)["token_ids"]) > 0 for s in seq_ids), 30, "all six running")

    # A stream followed from before the pause, and (below) one opened during it: the hub
    # that serves both cannot write its wake-up then.
    events: dict[str, list] = {seq_ids[1]: [], seq_ids[2]: []}
    readers = [Client(api.url, timeout_s=60) for _ in events]

    def follow(reader: Client, seq_id: str) -> threading.Thread:
        thread = threading.Thread(target=lambda: events[seq_id].extend(reader.events(seq_id)), daemon=True)
        thread.start()
        return thread

    threads = [follow(readers[0], seq_ids[2])]
    redis.config_set("maxmemory-policy", "noeviction")
    redis.config_set("maxmemory", int(redis.info("memory")["used_memory"]) // 2)
    try:
        with httpx.Client(base_url=api.url, timeout=30) as http:
            refused = http.post("/generate", json={"prompt": "hello", "max_tokens": 4})
            assert refused.status_code == 503 and "out of memory" in refused.json()["message"]
            assert refused.headers["Retry-After"]
            # The same keep-alive connection serves the next request.
            assert http.get("/health").status_code == 200
            assert http.get(f"/result/{seq_ids[0]}").status_code == 200
            ready = http.get("/ready")
            assert ready.status_code == 503 and "refuses writes" in ready.json()["message"]
        threads.append(follow(readers[1], seq_ids[1]))
        time.sleep(3.0)
        assert worker.process.poll() is None  # waiting, not dead
    finally:
        redis.config_set("maxmemory", 0)
    for thread in threads:
        thread.join(60)
    for reader in readers:
        reader.close()
    wait_until(lambda: all(client.result(s)["status"] == "finished" for s in seq_ids), 60, "all six to finish")
    assert_finished_once(client, redis, seq_ids, offline_greedy(model, requests))
    for seq_id, seen in events.items():
        assert seen[-1][0] == "end" and seen[-1][1]["status"] == "finished"
        assert "".join(data["text"] for event, data in seen if event == "delta") == client.result(seq_id)["text"]
    assert all(job.worker_name == worker_name for job in jobs(redis, seq_ids))  # never requeued
    assert "out of memory" in worker.log()


def test_sigterm_drains_then_requeues_and_workers_share_the_queue(service, model):
    client, redis_server, start_worker, api = service
    redis = Redis.from_url(redis_server.url)
    # The short job ends well within the drain; the long ones (3000 steps) cannot.
    draining = start_worker(drain_timeout_s=0.5)
    wait_for_worker(api.url)
    short = long_requests(1, max_tokens=10)
    long = long_requests(3, max_tokens=3000)
    short_id, *long_ids = [client.submit(**body)["seq_id"] for body in short + long]
    wait_until(lambda: all(client.result(s)["status"] == "running" for s in long_ids), 30, "jobs running")

    draining.process.send_signal(signal.SIGTERM)
    # Long enough that the two workers, resumed together, both take some (each notices within a second or so).
    late_ids = [client.submit(**body)["seq_id"] for body in long_requests(12, max_tokens=1000)]  # not admitted now
    assert draining.process.wait(30) == 0
    # What finished in time finished; what did not went back to the queue, at its front.
    assert client.result(short_id)["status"] == "finished"
    assert [client.result(s)["status"] for s in long_ids + late_ids] == ["queued"] * 15
    assert Job.fetch(long_ids[0], connection=redis, serializer=JSONSerializer).get_position() < 3

    # Two workers with small batches share the rest: both are up before either takes a job,
    # else on a loaded machine the first to load its model can run everything alone.
    suspend(redis)
    for _ in range(2):
        start_worker(max_inflight=4)
    wait_until(lambda: [w["state"] for w in ready_workers(api.url)] == ["suspended"] * 2, 90, "two workers")
    resume(redis)
    wait_until(lambda: all(client.result(s)["status"] == "finished" for s in long_ids + late_ids), 90, "all to finish")
    assert_finished_once(client, redis, long_ids, offline_greedy(model, long))
    ran_on = {job.worker_name for job in jobs(redis, late_ids + long_ids)}
    drained = Job.fetch(short_id, connection=redis, serializer=JSONSerializer).worker_name
    assert len(ran_on) == 2 and drained not in ran_on


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_worker_stopped_while_its_engine_loads_exits_at_once_with_its_core(model, redis_server, tmp_path, signum,
                                                                            status):
    """SIGINT or SIGTERM before the worker listens, its engine core process loading, stops
    it at once and the core with it: SIGINT too where it came in ignored, as in a worker
    started in a script's background (it was ignored until RQ's handlers took over), and
    SIGTERM without leaving the core to find out by itself."""
    settings = service_settings(model, redis_server.url, tmp_path, queue_name=f"stopped-loading-{signum}")
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen([sys.executable, "-m", "pagedq.cli", "worker"], env={**os.environ, **settings.to_env()},
                                  stdout=log, stderr=subprocess.STDOUT,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        (core,) = wait_until(lambda: processes_below("pagedq.core.process", worker.pid), 60, "the engine core to start")
        worker.send_signal(signum)
        assert worker.wait(30) == status, (tmp_path / "worker.log").read_text()
        core.wait(5)  # psutil.TimeoutExpired while it lives on
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler of its own for `signum` (Linux: SigCgt in /proc)."""
    status = open(f"/proc/{pid}/status").read()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signum - 1) & 1)


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_an_api_stopped_while_it_starts_exits_at_once(model, redis_server, tmp_path, signum, status):
    """SIGINT or SIGTERM while the api imports and builds its app (seconds, before uvicorn
    serves and installs its handlers) stops it then, SIGINT too where it came in ignored: it
    was lost before, and the api went on to serve."""
    settings = service_settings(model, redis_server.url, tmp_path, queue_name=f"api-stopped-starting-{signum}")
    log_path = tmp_path / "api.log"
    with open(log_path, "wb") as log:
        api = subprocess.Popen([sys.executable, "-m", "pagedq.cli", "api", "--workers", "1"],
                               env={**os.environ, **settings.to_env()}, stdout=log, stderr=subprocess.STDOUT,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_until(lambda: _catches(api.pid, signum), 30, "the api to handle the signal", interval_s=0.01)
        api.send_signal(signum)
        # uvicorn's handlers, had they taken it, shut down gracefully with status 0.
        assert api.wait(30) == status, log_path.read_text()
        assert "Uvicorn running" not in log_path.read_text()
    finally:
        if api.poll() is None:
            api.kill()
            api.wait()


def test_a_stalled_worker_writes_nothing_for_jobs_rerun_elsewhere(service, model):
    """Fencing: SIGSTOP a worker mid-generation until a second worker has reaped and rerun
    its jobs, then SIGCONT it: it runs a step and tries to publish and finish before it
    learns the jobs are gone; every such write is refused by Redis (the execution no
    longer owns its job). Each rerun's stream is its final text, nothing after `end`, and
    the partial result never goes back to attempt 1."""
    client, redis_server, start_worker, api = service
    redis = Redis.from_url(redis_server.url)
    stalled = start_worker(heartbeat_ttl_s=2)
    first = wait_for_worker(api.url)["name"]
    # Long enough that none ends before the SIGSTOP: on a loaded machine the 16 result
    # reads that see them all generating took as long as 250 tokens (11 jobs finished first).
    requests = long_requests(16, max_tokens=1500)
    seq_ids = [client.submit(**body)["seq_id"] for body in requests]
    wait_until(lambda: all(len(client.result(s)["token_ids"]) > 0 for s in seq_ids), 30, "all 16 generating")

    stalled.process.send_signal(signal.SIGSTOP)
    try:
        start_worker(heartbeat_ttl_s=2)
        # Rerun elsewhere: every job started again by the second worker.
        wait_until(
            lambda: all(job.get_status(refresh=False) in ("started", "finished") and job.worker_name != first
                        for job in jobs(redis, seq_ids)),
            60, "the second worker to rerun all 16",
        )
    finally:
        stalled.process.send_signal(signal.SIGCONT)
    wait_until(lambda: all(client.result(s)["status"] == "finished" for s in seq_ids), 60, "all 16 to finish")
    wait_until(lambda: "no longer ours" in stalled.log() or "dropped" in stalled.log(), 30, "the stalled worker to notice")
    time.sleep(0.5)  # anything it still had to send has gone out (and been refused)

    assert_finished_once(client, redis, seq_ids, offline_greedy(model, requests))
    for seq_id, job in zip(seq_ids, jobs(redis, seq_ids)):
        events = [(fields[b"type"].decode(), fields) for _, fields in redis.xrange(f"pagedq:stream:{seq_id}")]
        kinds = [kind for kind, _ in events]
        assert kinds.count("end") == 1 and kinds[-1] == "end", (seq_id, kinds[-5:])
        rerun = max(i for i, kind in enumerate(kinds) if kind == "reset")
        text = "".join(fields[b"text"].decode() for kind, fields in events[rerun:] if kind == "delta")
        counts = [int(fields[b"num_tokens"]) for kind, fields in events[rerun:] if kind == "delta"]
        assert text == client.result(seq_id)["text"]
        assert counts == sorted(counts)  # no stale `... 52 53 8 54 ...`
        assert job.meta["progress"]["attempt"] == 2


def test_a_worker_that_takes_its_own_reaped_jobs_again_runs_each_once(model, tmp_path):
    """A worker whose loop stalled past its heartbeat TTL reaps its own jobs and may take
    them again (the I/O thread starts them, the loop hands them to the engine between steps)
    before a check says the earlier runs are no longer its own. The earlier run of each is
    dropped then: the publisher follows a job's stream by job id, and with two runs in flight
    the old run's tokens went into the new run's stream, and dropping the old run later
    forgot the new one's state (the worker died on a KeyError). In the worker's own loop, in
    this process: the reap and the retake are done by hand, then the loop runs both jobs
    to their end. Each finishes once, with the offline engine's tokens, and its stream's last
    attempt holds exactly its text."""
    from rq import Queue, Retry

    from pagedq.redis_schema import JOB_FUNCTION
    from worker.rq.batch_worker import BatchWorker
    from worker.rq.engine_factory import build_engine

    redis_server = RedisServer(tmp_path / "redis").start()
    threads = torch.get_num_threads()
    requests = long_requests(2, max_tokens=300)
    seq_ids = ["retaken-0", "retaken-1"]
    try:
        redis = Redis.from_url(redis_server.url)
        settings = service_settings(model, redis_server.url, tmp_path, queue_name="retaken", job_retries=2)
        queue = Queue("retaken", connection=redis, serializer=JSONSerializer)
        for seq_id, body in zip(seq_ids, requests):
            kwargs = {"prompt": None, "prompt_token_ids": body["prompt_token_ids"], "beam": None, "priority": 0,
                      "sampling": {"max_tokens": body["max_tokens"], "temperature": 0, "ignore_eos": True},
                      "enqueued_at": time.time(), "stream": True}
            queue.enqueue_job(queue.create_job(JOB_FUNCTION, kwargs=kwargs, job_id=seq_id, retry=Retry(max=2)))
        worker = BatchWorker(build_engine(settings), settings, Redis.from_url(redis_server.url))
        worker.bootstrap()
        try:
            # Their first deltas: under load a round trip can span many steps, and waiting for
            # several let both jobs end before the stall (an empty registry, in one CI run).
            wait_until(lambda: worker._tick() or all(redis.xlen(f"pagedq:stream:{s}") >= 1 for s in seq_ids), 30,
                       "both jobs to stream here")
            if worker._pending is not None:
                worker._take_pending()
            # The stall: every execution expired; its own reaper requeues the jobs (a retry each).
            registry = queue.started_job_registry
            members = redis.zrange(registry.key, 0, -1)
            assert len(members) == 2, f"the jobs ended before the stall: {members}"
            redis.zadd(registry.key, {member: 1 for member in members})
            worker.reaper.reap()
            assert queue.count == 2
            # Taken again and handed to the engine while the earlier runs are still in flight.
            worker._hand_all(worker._start_jobs([as_text(redis.lmove(queue.key, queue.intermediate_queue_key))
                                                 for _ in seq_ids]))
            wait_until(lambda: worker._tick() or all(job.get_status(refresh=False) == "finished"
                                                     for job in jobs(redis, seq_ids)), 60, "both to finish")
        finally:
            worker.teardown()
        expected = offline_greedy(model, requests)
        for seq_id, job, tokens in zip(seq_ids, jobs(redis, seq_ids), expected):
            result = job.latest_result().return_value
            assert result["token_ids"] == tokens and len(job.results()) == 1
            events = [(fields[b"type"].decode(), fields) for _, fields in redis.xrange(f"pagedq:stream:{seq_id}")]
            kinds = [kind for kind, _ in events]
            assert kinds.count("end") == 1 and kinds[-1] == "end", (seq_id, kinds[-5:])
            rerun = max(i for i, kind in enumerate(kinds) if kind == "reset")
            text = "".join(fields[b"text"].decode() for kind, fields in events[rerun:] if kind == "delta")
            assert text == result["text"]
    finally:
        torch.set_num_threads(threads)
        redis_server.stop()


def test_a_failure_or_drain_writes_nothing_for_a_job_rerun_elsewhere(model, tmp_path):
    """Fencing of the failure and drain paths, in the worker's own loop (in this process,
    so its engine can be made to fail on demand): two jobs start here, then both are
    handed to another execution (as a reaper and a second worker would after a stall).
    An engine failure would have RQ retry the first (requeue) or fail it; a drain would
    requeue the second. Neither may happen: the other execution owns them now."""
    from rq import Queue, Retry

    from pagedq.redis_schema import JOB_FUNCTION, record_execution
    from worker.rq.batch_worker import BatchWorker
    from worker.rq.engine_factory import build_engine

    redis_server = RedisServer(tmp_path / "redis").start()
    threads = torch.get_num_threads()
    try:
        redis = Redis.from_url(redis_server.url)
        settings = service_settings(model, redis_server.url, tmp_path, queue_name="fencing", job_retries=2)
        queue = Queue("fencing", connection=redis, serializer=JSONSerializer)
        for seq_id in ("fenced-fail", "fenced-drain"):
            kwargs = {"prompt": None, "prompt_token_ids": [5, 6, 7], "beam": None, "priority": 0,
                      "sampling": {"max_tokens": 200, "temperature": 0, "ignore_eos": True},
                      "enqueued_at": time.time(), "stream": True}
            queue.enqueue_job(queue.create_job(JOB_FUNCTION, kwargs=kwargs, job_id=seq_id, retry=Retry(max=2)))
        worker = BatchWorker(build_engine(settings), settings, Redis.from_url(redis_server.url))
        worker.bootstrap()
        try:
            wait_until(lambda: worker._tick() or len(worker.inflight) == 2, 30, "both jobs to start here")
            entries = {entry.job.id: entry for entry in worker.inflight}
            with redis.pipeline() as pipeline:
                for job in jobs(redis, list(entries)):
                    record_execution(pipeline, job, f"{job.id}:another-execution")
                pipeline.execute()
            drained = entries["fenced-drain"]
            worker.inflight.remove(drained)  # kept for the drain below
            worker._fail_inflight((RuntimeError, RuntimeError("engine failure"), None))
            worker.inflight.add(drained)
            worker._requeue_inflight()
        finally:
            worker.teardown()
        assert queue.count == 0, "a job owned by another execution was queued again"
        for job in jobs(redis, ["fenced-fail", "fenced-drain"]):
            assert job.get_status() == "started" and job.latest_result() is None
            assert job.retries_left == 2
        assert queue.failed_job_registry.count == 0
    finally:
        torch.set_num_threads(threads)
        redis_server.stop()


def test_a_leaving_worker_stops_rqs_pubsub_thread_at_once(model, tmp_path):
    """RQ's teardown unsubscribes its stop-job channel and then stops the pubsub thread;
    redis-py 8.2's stop() waits for the thread to end. A thread that read the unsubscribe
    reply before the stop waited RQ's 60 s for a subscription, and the worker with it (a
    worker whose engine died, under load, had not exited 30 s later). Here the thread is put
    in that state by hand, then the worker tears down."""
    from worker.rq.batch_worker import BatchWorker
    from worker.rq.engine_factory import build_engine

    redis_server = RedisServer(tmp_path / "redis").start()
    try:
        settings = service_settings(model, redis_server.url, tmp_path, queue_name="leaving")
        worker = BatchWorker(build_engine(settings), settings, Redis.from_url(redis_server.url))
        try:
            worker.bootstrap()
            wait_until(lambda: worker.pubsub.subscribed, 10, "the stop-job subscription")
            worker.pubsub.unsubscribe()
            wait_until(lambda: not worker.pubsub.subscribed, 10, "the thread to read the unsubscribe reply")
            left = threading.Thread(target=worker.teardown, daemon=True)
            left.start()
            left.join(20)
            assert not left.is_alive() and not worker.pubsub_thread.is_alive()
        finally:
            worker.engine.shutdown()
    finally:
        redis_server.stop()
