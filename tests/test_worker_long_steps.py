"""A worker whose engine step takes longer than its heartbeat TTL (a long prefill on a CPU
core, as when summarizing with SmolLM2) keeps its job: it beats during the step
(worker/rq/step_heartbeats.py). Before, it reaped its own job after the step, reran it,
and failed it once out of retries. So does one whose hand-over of a request to the engine
(its input processing) takes that long."""

from __future__ import annotations

import random
import time

import pytest
import torch
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from pagedq.client import Client
from pagedq.redis_server import RedisServer
from tests.service_helpers import ApiServer, WorkerProcess, service_settings, wait_for_worker, wait_until

pytestmark = pytest.mark.slow
TTL_S = 2


def test_a_step_longer_than_the_heartbeat_ttl_keeps_its_job(tiny_model_dir, tmp_path):
    # 33M parameters: one 4000-token prefill step takes ~5 s on one core.
    model = tiny_model_dir(hidden_size=512, num_hidden_layers=8, intermediate_size=2048, num_attention_heads=8,
                           num_key_value_heads=8, max_position_embeddings=4096)
    redis_server = RedisServer(tmp_path / "redis").start()
    settings = service_settings(model, redis_server.url, tmp_path, heartbeat_ttl_s=TTL_S, reaper_interval_s=0.5,
                                max_num_batched_tokens=4096, max_model_len=4096)
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    api = ApiServer(settings).start()
    try:
        wait_for_worker(api.url)
        prompt = [random.Random(0).randrange(3, 500) for _ in range(4000)]
        with Client(api.url, timeout_s=120) as client:
            seq_id = client.submit(prompt_token_ids=prompt, max_tokens=2, temperature=0)["seq_id"]
            result = client.wait(seq_id)
        assert result["status"] == "finished", result
        (job,) = Job.fetch_many([seq_id], Redis.from_url(redis_server.url), serializer=JSONSerializer)
        # Run once, never requeued (before: reaped by its own worker after the step, and rerun).
        assert job.retries_left == settings.job_retries and "enqueued for retry" not in worker.log(), worker.log()
        assert len(job.results()) == 1
        assert (job.ended_at - job.started_at).total_seconds() > 1.5 * TTL_S  # the step did outlast the TTL
    finally:
        api.stop()
        worker.stop()
        redis_server.stop()


def test_a_hand_over_longer_than_the_heartbeat_ttl_keeps_the_jobs_in_flight(tiny_model_dir, tmp_path, monkeypatch):
    """A request whose input processing outlasts the TTL (20,000 bad words took minutes
    before their tokenizing was batched) held the loop without a beat: every job in flight
    expired, and the worker's own reaper requeued them all. In the worker's loop, in this
    process: a second job's hand-over to the engine is made to take 2.5 TTLs while the first
    one runs; the first's execution is still alive afterwards, and nothing is reaped."""
    from rq import Queue

    from pagedq.redis_schema import JOB_FUNCTION
    from worker.rq.batch_worker import BatchWorker
    from worker.rq.engine_factory import build_engine

    redis_server = RedisServer(tmp_path / "redis").start()
    threads = torch.get_num_threads()
    try:
        redis = Redis.from_url(redis_server.url)
        settings = service_settings(tiny_model_dir(), redis_server.url, tmp_path, queue_name="slow-hand-over",
                                    heartbeat_ttl_s=TTL_S)
        queue = Queue("slow-hand-over", connection=redis, serializer=JSONSerializer)

        def enqueue(seq_id: str, max_tokens: int) -> None:
            kwargs = {"prompt": None, "prompt_token_ids": [5, 6, 7], "beam": None, "priority": 0,
                      "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                      "enqueued_at": time.time(), "stream": True}
            queue.enqueue_job(queue.create_job(JOB_FUNCTION, kwargs=kwargs, job_id=seq_id))

        worker = BatchWorker(build_engine(settings), settings, Redis.from_url(redis_server.url))
        worker.bootstrap()
        worker.heartbeats.start()
        try:
            enqueue("running", 100_000)
            wait_until(lambda: worker._tick() or len(worker.inflight) == 1, 30, "the first job to start")
            add_request = worker.engine.add_request

            def slow_add_request(request_id, *args, **kwargs):
                time.sleep(2.5 * TTL_S)
                return add_request(request_id, *args, **kwargs)

            monkeypatch.setattr(worker.engine, "add_request", slow_add_request)
            enqueue("slow", 4)
            wait_until(lambda: worker._tick() or len(worker.inflight) == 2, 60, "the second job's hand-over")
            assert queue.started_job_registry.get_expired_job_ids() == []
            assert worker.reaper.reap() == 0
        finally:
            worker.heartbeats.stop()
            worker.teardown()
    finally:
        torch.set_num_threads(threads)
        redis_server.stop()
