"""A worker whose engine step takes longer than its heartbeat TTL (a long prefill on a CPU
core, as when summarizing with SmolLM2) keeps its job: it beats during the step
(worker/rq/step_heartbeats.py). Before, it reaped its own job after the step, reran it,
and failed it once out of retries."""

from __future__ import annotations

import random

import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from pagedq.client import Client
from pagedq.redis_server import RedisServer
from tests.service_helpers import ApiServer, WorkerProcess, service_settings, wait_for_worker

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
