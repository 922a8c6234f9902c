"""Tensor parallelism on the CPU (gloo, real rank processes): two ranks generate exactly
what one does, fp32 greedy, for every architecture, through chunked prefill, preemption
and the prefix cache; shapes that do not split are refused; a rank SIGKILLed mid-step
stops the engine within seconds (offline); in the service, a worker whose rank dies
requeues its jobs, which finish elsewhere with the same tokens, and exits, also when the
rank dies while it idles."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch.distributed as dist
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from pagedq import LLM, SamplingParams
from pagedq.client import Client
from pagedq.front.core_client import EngineDeadError
from pagedq.redis_server import RedisServer
from tests.service_helpers import (
    ApiServer,
    WorkerProcess,
    offline_greedy,
    processes_below,
    ready_workers,
    service_settings,
    wait_until,
)

# Past the token budget (32): every prompt is prefilled in chunks. A shared first block
# (16 tokens): later prompts find it in the prefix cache. 12 blocks of 16 tokens cannot
# hold six sequences growing to 70-80 tokens: some are preempted.
PREFIX = list(range(11, 27))
PROMPTS = [PREFIX + [5 + (i * 7 + j) % 300 for j in range(40 + 5 * i)] for i in range(6)]
ENGINE = dict(device="cpu", max_num_batched_tokens=32, num_gpu_blocks_override=12)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Rows beside the plain ones: prompt positions' logits (every rank gathers them) and a grammar's mask.
PARAMS = [SamplingParams(**{**GREEDY.model_dump(), "prompt_logprobs": 1}),
          SamplingParams(**{**GREEDY.model_dump(), "structured_outputs": {"regex": "[a-z]{3}[0-9]{1,5}"}}),
          *[GREEDY] * (len(PROMPTS) - 2)]

# Each architecture with a sharding case of its own besides the plain split.
SHAPES = {
    "llama": dict(num_key_value_heads=1, vocab_size=509),  # KV head replicated on both ranks; padded vocabulary
    "mistral": dict(tie_word_embeddings=True),  # the LM head is the vocabulary-parallel embedding
    "qwen2": dict(),
    "qwen3": dict(),
    "gpt2": dict(),  # q, k and v stacked in one checkpoint tensor
}
# How each preempts: swapping moves KV blocks on every rank (the block moves are sent too).
PREEMPTION = {"qwen2": "swap"}


def rank_processes(parent: int | None = None) -> list[psutil.Process]:
    """Tensor-parallel ranks 1..N-1 below this process (or below `parent`)."""
    return processes_below("worker.tp.follower", parent)


def run(model_dir, tensor_parallel_size: int, preemption_mode: str) -> tuple[list[list[int]], dict, int, list[float]]:
    """(each prompt's tokens, the engine's stats, KV heads in rank 0's cache, the first
    prompt's logprobs of its own tokens)."""
    llm = LLM(str(model_dir), tensor_parallel_size=tensor_parallel_size, preemption_mode=preemption_mode,
              swap_space=0.01, **ENGINE)
    engine = llm.llm_engine
    try:
        runner = engine.core.core.runner
        assert len(rank_processes()) == tensor_parallel_size - 1
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        prompt_logprobs = [entry[token].logprob for entry, token in zip(outputs[0].prompt_logprobs[1:], PROMPTS[0][1:])]
        return ([o.outputs[0].token_ids for o in outputs], stats, runner.kv_cache.layers[0][0].shape[2],
                prompt_logprobs)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", sorted(SHAPES))
def test_two_ranks_generate_what_one_does(tiny_model_dir, arch):
    shape = SHAPES[arch]
    model_dir = tiny_model_dir(arch, **shape)
    mode = PREEMPTION.get(arch, "recompute")
    one, _, heads_one, logprobs_one = run(model_dir, 1, mode)
    two, stats, heads_two, logprobs_two = run(model_dir, 2, mode)
    assert two == one
    assert logprobs_two == pytest.approx(logprobs_one, abs=1e-4) and len(logprobs_one) == len(PROMPTS[0]) - 1
    # What was exercised: every rank holds its own KV heads (or a replica of the one), the
    # cache ran out, the shared prefix was found.
    assert heads_two == (1 if shape.get("num_key_value_heads") == 1 else heads_one // 2)
    assert stats["num_preemptions_" + mode] > 0
    assert stats["prefix_cache_hits"] > 0
    assert rank_processes() == [] and not dist.is_initialized()


def test_shapes_that_do_not_split_are_refused_before_any_rank_starts(tiny_model_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide the model's num_attention_heads \(4\)"):
        LLM(str(tiny_model_dir("llama")), tensor_parallel_size=3, **ENGINE)
    assert rank_processes() == []


def test_a_rank_killed_mid_step_stops_the_engine_within_seconds(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), tensor_parallel_size=2, device="cpu")
    engine = llm.llm_engine
    (rank,) = rank_processes()
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for i in range(8):
        engine.add_request(str(i), {"prompt_token_ids": [5 + i, 6, 7]}, params)
    engine.step()  # running
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(rank.pid, signal.SIGKILL)

    # While the main thread steps without pause: the kill lands inside a step, or between two.
    threading.Timer(0.3, kill).start()
    steps = 0
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        while True:
            engine.step()
            steps += 1
    assert steps > 0 and time.monotonic() - killed_at[0] < 5
    # Dead for good: a new request's step says so at once.
    engine.add_request("after", {"prompt_token_ids": [5, 6, 7]}, params)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        engine.step()
    assert time.monotonic() - started < 1
    assert rank_processes() == [] and not dist.is_initialized()
    engine.shutdown()


@pytest.mark.slow
def test_a_worker_whose_rank_dies_requeues_its_jobs_and_they_finish_elsewhere(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama", max_position_embeddings=4096)
    redis_server = RedisServer(tmp_path / "redis").start()
    settings = service_settings(model, redis_server.url, tmp_path)
    api = ApiServer(settings).start()
    redis = Redis.from_url(redis_server.url)
    # Two tensor-parallel workers, started together (their start is most of this test's time).
    tp2 = settings.with_overrides(tensor_parallel_size=2)
    workers = [WorkerProcess(tp2, tmp_path / f"worker-{i}.log") for i in range(2)]
    try:
        ready = wait_until(lambda: len(found := ready_workers(api.url)) == 2 and found, 120, "both workers")
        assert [w["tensor_parallel_size"] for w in ready] == [2, 2]
        by_name = {w["name"]: next(p for p in workers if p.process.pid == int(redis.hget(f"rq:worker:{w['name']}", "pid")))
                   for w in ready}
        requests = [{"prompt_token_ids": [7 + (i * 13 + j) % 400 for j in range(4 + i)], "max_tokens": 120,
                     "ignore_eos": True, "temperature": 0} for i in range(4)]
        with Client(api.url, timeout_s=60) as client:
            seq_ids = [client.submit(**body)["seq_id"] for body in requests]
            wait_until(lambda: all(len(client.result(s)["token_ids"]) > 0 for s in seq_ids), 60, "every job's tokens")
            # The worker running the most of them loses a rank mid-step.
            holders = [job.worker_name for job in Job.fetch_many(seq_ids, connection=redis, serializer=JSONSerializer)]
            doomed = by_name[max(set(holders), key=holders.count)]
            (rank,) = rank_processes(doomed.process.pid)
            rank.kill()
            killed_at = time.monotonic()
            assert doomed.process.wait(30) != 0
            assert time.monotonic() - killed_at < 10
            wait_until(lambda: all(client.result(s)["status"] == "finished" for s in seq_ids), 60, "every job to finish")
            assert [client.result(s)["token_ids"] for s in seq_ids] == offline_greedy(model, requests)
            fetched = Job.fetch_many(seq_ids, connection=redis, serializer=JSONSerializer)
            assert [sum(r.type == r.Type.SUCCESSFUL for r in job.results()) for job in fetched] == [1] * len(seq_ids)
            # As a dead worker's (the reaper's requeue): the dead engine's jobs each spent a retry, the others none.
            died = next(name for name, worker in by_name.items() if worker is doomed)
            assert [job.retries_left for job in fetched] == [
                settings.job_retries - (holder == died) for holder in holders]
            # A rank that dies while its worker idles ends that worker too, not the next job's step.
            (survivor,) = [w for w in workers if w is not doomed]
            (rank,) = rank_processes(survivor.process.pid)
            rank.kill()
            killed_at = time.monotonic()
            assert survivor.process.wait(30) != 0
            assert time.monotonic() - killed_at < 10
    finally:
        api.stop()
        for worker in workers:
            worker.stop()
        redis_server.stop()
