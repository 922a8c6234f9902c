"""The service end to end: a real redis-server, the api under real uvicorn, and one
`pagedq worker` process shared by the module. Results are checked against pagedq's
offline engine on the same tiny model, and against RQ's own view of the jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timezone

import httpx
import pytest
import torch
from redis import Redis
from rq.command import send_stop_job_command
from rq.job import Job
from rq.registry import FinishedJobRegistry
from rq.serializers import JSONSerializer
from rq.suspension import resume

from pagedq.client import Client, SSEParser
from pagedq.protocol import GenerationResult
from pagedq.redis_schema import stream_key
from pagedq.redis_server import RedisServer
from tests.service_helpers import (
    REPO,
    ApiServer,
    WorkerProcess,
    offline_greedy,
    offline_outputs,
    service_settings,
    suspend_workers,
    wait_for_worker,
    wait_until,
)

pytestmark = pytest.mark.slow
QUEUE = "e2e"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir()


@pytest.fixture(scope="module")
def service(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    redis_server = RedisServer(tmp / "redis").start()
    settings = service_settings(model, redis_server.url, tmp, queue_name=QUEUE)
    worker = WorkerProcess(settings, tmp / "worker.log")
    api = ApiServer(settings).start()
    try:
        wait_for_worker(api.url)
        yield api, Redis.from_url(redis_server.url), worker
    finally:
        api.stop()
        worker.stop()
        redis_server.stop()


@pytest.fixture
def client(service):
    api, _, _ = service
    with Client(api.url, timeout_s=60) as client:
        yield client


def fetch(redis: Redis, seq_id: str) -> Job:
    return Job.fetch(seq_id, connection=redis, serializer=JSONSerializer)


def engine_stats(api_url: str) -> dict:
    (worker,) = httpx.get(f"{api_url}/ready", timeout=10).json()["workers"]
    return worker["engine"]


def test_fifty_concurrent_requests_match_the_offline_engine(service, client, model):
    api, redis, _ = service
    requests = [
        {"prompt": f"Request number {i}: tell me something", "max_tokens": 6 + i % 7, "temperature": 0}
        if i % 2 else
        {"prompt_token_ids": [3 + (i * 7 + j) % 500 for j in range(5 + i % 11)], "max_tokens": 12, "temperature": 0}
        for i in range(50)
    ]
    finished_before = FinishedJobRegistry(QUEUE, connection=redis).count
    with ThreadPoolExecutor(50) as pool:
        seq_ids = list(pool.map(lambda body: client.submit(**body)["seq_id"], requests))
        results = list(pool.map(client.wait, seq_ids))

    expected = offline_greedy(model, requests)
    assert [r["status"] for r in results] == ["finished"] * 50
    assert [r["token_ids"] for r in results] == expected
    for body, result in zip(requests, results):
        assert result["finish_reason"] in ("length", "stop")
        assert result["usage"]["completion_tokens"] == len(result["token_ids"])
        timings = result["timings"]
        assert timings["enqueued"] <= timings["started"] <= timings["first_token"] <= timings["finished"]
    # RQ tells the same story.
    for seq_id, result in zip(seq_ids, results):
        job = fetch(redis, seq_id)
        assert job.get_status() == "finished"
        recorded = GenerationResult.model_validate(job.return_value())
        assert recorded.seq_id == seq_id and recorded.token_ids == result["token_ids"]
        assert len(job.results()) == 1
    assert FinishedJobRegistry(QUEUE, connection=redis).count == finished_before + 50


def _submit_burst(client: Client, count: int) -> list[str]:
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda i: client.submit(prompt_token_ids=[3 + i, 7, 11], max_tokens=8,
                                                     temperature=0)["seq_id"], range(count)))


def _assert_first_handed_before_last_started(client: Client, redis: Redis, seq_ids: list[str]) -> None:
    """The engine had the first jobs of a burst before the I/O thread had marked the last
    ones started (RQ's bookkeeping, a chunk at a time)."""
    results = [client.wait(seq_id) for seq_id in seq_ids]
    assert [r["status"] for r in results] == ["finished"] * len(seq_ids)
    handed = [r["timings"]["started"] for r in results]  # when the engine got the job
    marked = [fetch(redis, seq_id).started_at.replace(tzinfo=timezone.utc).timestamp() for seq_id in seq_ids]
    assert min(handed) < max(marked), (min(handed), max(marked))


def test_a_burst_taken_at_once_reaches_the_engine_a_chunk_at_a_time(service, client):
    """A round trip that takes a burst while the engine is busy starts it (RQ's bookkeeping)
    in chunks, and the engine thread hands each chunk to the engine between its steps.
    Before, every job waited for the whole burst's start."""
    api, redis, _ = service
    # 64 samples of 1,000 tokens: seconds of steps (one sample took 0.4 s on a fast day,
    # less than the suspension and the burst's submission).
    busy = client.submit(prompt_token_ids=[5, 6, 7], n=64, max_tokens=1000, ignore_eos=True, temperature=1.0,
                         seed=1)["seq_id"]
    wait_until(lambda: client.result(busy)["status"] == "running", 30, "the first job to run")
    suspend_workers(redis, api.url)  # the engine steps on; the burst waits in the queue
    try:
        seq_ids = _submit_burst(client, 100)
        assert client.result(busy)["status"] == "running"  # else the burst would meet an idle engine
    finally:
        resume(redis)  # the worker's next round trip takes the burst at once
    _assert_first_handed_before_last_started(client, redis, seq_ids)
    assert client.wait(busy)["status"] == "finished"


def test_a_burst_taken_by_an_idle_engine_starts_with_its_first_chunk(service, client):
    """An idle engine waits for the round trip that takes a burst only until its first chunk
    is started; the rest follow between its steps. Before, it waited for the whole start."""
    api, redis, _ = service
    suspend_workers(redis, api.url)  # the engine idles; the burst waits in the queue
    try:
        seq_ids = _submit_burst(client, 100)
        assert engine_stats(api.url)["num_running"] == 0
    finally:
        resume(redis)  # the worker's next round trip takes the burst at once
    _assert_first_handed_before_last_started(client, redis, seq_ids)


def test_parallel_samples_run_as_one_job_and_stream_by_index(service, client, model):
    body = {"prompt": "Three ways to say hello", "n": 3, "temperature": 0.9, "seed": 11, "max_tokens": 10,
            "ignore_eos": True}
    (expected,) = offline_outputs(model, [body])
    seq_id = client.submit(**body)["seq_id"]
    events = list(client.events(seq_id))
    result = client.result(seq_id)

    assert result["status"] == "finished"
    completions = result["completions"]
    assert [c["index"] for c in completions] == [0, 1, 2]
    assert [c["token_ids"] for c in completions] == expected  # seeded: the same samples as offline
    assert len({tuple(ids) for ids in expected}) == 3  # and three different ones
    assert result["token_ids"] == expected[0] and result["text"] == completions[0]["text"]
    assert result["usage"]["completion_tokens"] == 30
    for completion in completions:
        deltas = [data for event, data in events if event == "delta" and data["index"] == completion["index"]]
        assert "".join(d["text"] for d in deltas) == completion["text"]
        assert deltas[-1]["num_tokens"] == 10
    assert events[-1] == ("end", {"status": "finished", "finish_reason": "length"})


def test_polling_and_streaming_follow_a_job_from_queued_to_finished(service, client):
    api, redis, _ = service
    suspend_workers(redis, api.url)  # the worker stops admitting: the job stays queued while we look
    try:
        seq_id = client.submit(prompt="Once upon a time", max_tokens=700, ignore_eos=True, temperature=0)["seq_id"]
        events = []
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(lambda: events.extend(client.events(seq_id)))
            for _ in range(3):
                assert client.result(seq_id)["status"] == "queued"
                time.sleep(0.1)
            resume(redis)
            partial_lengths = []
            while (result := client.result(seq_id))["status"] != "finished":
                if result["status"] == "running":
                    partial_lengths.append(len(result["token_ids"]))
                    assert result["text"] is not None and result["usage"]["prompt_tokens"] > 0
                time.sleep(0.02)
            streaming.result(timeout=30)
    finally:
        resume(redis)

    growing = [n for n in partial_lengths if 0 < n < 700]
    assert len(set(growing)) >= 2 and growing == sorted(growing), partial_lengths
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 700
    kinds = [event for event, _ in events]
    assert kinds[-1] == "end" and set(kinds[:-1]) == {"delta"}
    assert "".join(data["text"] for event, data in events if event == "delta") == result["text"]
    assert events[-2][1]["num_tokens"] == 700
    assert events[-1][1] == {"status": "finished", "finish_reason": "length"}


def test_a_running_jobs_result_shows_every_sample_so_far(service, client):
    """n > 1: GET /result of a running job shows each sample's text and tokens so far in
    `completions` (output 0 also as text/token_ids), each a prefix of what it ends with, and
    usage counts every sample's tokens, as the finished result does."""
    seq_id = client.submit(prompt="Samples", n=3, max_tokens=600, ignore_eos=True, temperature=1.0, seed=5)["seq_id"]
    running = []
    while (result := client.result(seq_id))["status"] != "finished":
        if result["status"] == "running" and result["usage"]["completion_tokens"] > 0:
            running.append(result)
        time.sleep(0.02)
    assert running, "never saw the job running"
    final = {completion["index"]: completion for completion in result["completions"]}
    assert len(final) == 3 and len({tuple(c["token_ids"]) for c in final.values()}) == 3
    for partial in running:
        samples = partial["completions"]
        assert [sample["index"] for sample in samples] == [0, 1, 2]
        assert (partial["text"], partial["token_ids"]) == (samples[0]["text"], samples[0]["token_ids"])
        assert partial["usage"]["completion_tokens"] == sum(len(sample["token_ids"]) for sample in samples)
        for sample in samples:
            whole = final[sample["index"]]
            assert sample["finish_reason"] is None
            assert whole["token_ids"][:len(sample["token_ids"])] == sample["token_ids"]
            assert whole["text"].startswith(sample["text"])
    assert any(all(sample["token_ids"] for sample in partial["completions"]) for partial in running)


def test_a_polling_clients_job_keeps_only_its_end_in_the_stream(service, client):
    """POST /generate with stream false (a client that polls): the job runs as any other and
    its result holds every token; its deltas went every PAGEDQ_PROGRESS_INTERVAL_S as its
    partial result and are dropped once it ends."""
    _, redis, _ = service
    polled = client.submit(prompt="Polled", max_tokens=40, ignore_eos=True, temperature=0, stream=False)["seq_id"]
    followed = client.submit(prompt="Polled", max_tokens=40, ignore_eos=True, temperature=0)["seq_id"]
    result = client.wait(polled)
    assert result["status"] == "finished" and len(result["token_ids"]) == 40
    assert client.wait(followed)["token_ids"] == result["token_ids"]
    assert fetch(redis, polled).kwargs["stream"] is False and fetch(redis, followed).kwargs["stream"] is True
    assert [fields[b"type"] for _, fields in redis.xrange(stream_key(polled))] == [b"end"]
    assert {fields[b"type"] for _, fields in redis.xrange(stream_key(followed))} == {b"delta", b"end"}


def test_stream_resumes_from_last_event_id(service, client):
    """A client that drops mid-stream reconnects with Last-Event-ID and misses nothing."""
    api, _, _ = service
    seq_id = client.submit(prompt="Resume", max_tokens=300, ignore_eos=True, temperature=0)["seq_id"]
    with httpx.Client(base_url=api.url, timeout=30) as http:
        before = read_sse(http, seq_id, {}, stop_after_deltas=5)
        last_id = before[-1][2]
        after = read_sse(http, seq_id, {"Last-Event-ID": last_id})
    final = client.wait(seq_id)
    text = [data["text"] for event, data, _ in before + after if event == "delta"]
    assert "".join(text) == final["text"]
    assert after[0][1]["num_tokens"] > before[-1][1]["num_tokens"]  # nothing replayed
    end = ("end", {"status": "finished", "finish_reason": "length"})
    assert after[-1][:2] == end
    # Resumed at the end, or past it (an id the stream never had): nothing more, and the end
    # as written (it came with finish_reason null, made of the job's state).
    end_id = after[-1][2]
    milliseconds, _, sequence = end_id.partition("-")
    with httpx.Client(base_url=api.url, timeout=30) as http:
        for cursor in (end_id, f"{milliseconds}-{int(sequence) + 1}", "18446744073709551615-18446744073709551615"):
            assert [frame[:2] for frame in read_sse(http, seq_id, {"Last-Event-ID": cursor})] == [end]


def read_sse(http: httpx.Client, seq_id: str, headers: dict, stop_after_deltas: int | None = None) -> list:
    frames, parser = [], SSEParser()
    with http.stream("GET", f"/stream/{seq_id}", headers=headers) as response:
        for line in response.iter_lines():
            if (frame := parser.feed(line)) is not None:
                frames.append(frame)
                if frame[0] == "delta" and len(frames) == stop_after_deltas:
                    break
    return frames


def test_cancel_a_queued_job_and_it_never_runs(service, client):
    api, redis, _ = service
    suspend_workers(redis, api.url)
    try:
        seq_id = client.submit(prompt="never", max_tokens=5)["seq_id"]
        assert client.cancel(seq_id)["status"] == "canceled"
    finally:
        resume(redis)
    # The worker is admitting again: a later job runs, the canceled one does not.
    later = client.wait(client.submit(prompt="after", max_tokens=3)["seq_id"])
    assert later["status"] == "finished"
    result = client.result(seq_id)
    assert result["status"] == "canceled" and result["token_ids"] == [] and result["timings"]["started"] is None
    assert fetch(redis, seq_id).started_at is None
    # Kept as long as a finished job, then gone with its prompt (RQ's cancel sets no TTL).
    assert 0 < redis.ttl(fetch(redis, seq_id).key) <= api.settings.result_ttl_s


def test_cancel_a_running_job_frees_its_blocks(service, client):
    api, redis, _ = service
    seq_id = client.submit(prompt="a long one", max_tokens=900, ignore_eos=True, temperature=0)["seq_id"]
    wait_until(lambda: len(client.result(seq_id)["token_ids"]) >= 20, 30, "the job to be generating")
    # The worker sends its engine stats with every step's round trip.
    busy = wait_until(lambda: (stats := engine_stats(api.url))["num_running"] == 1 and stats, 10, "fresh stats")
    assert busy["num_free_blocks"] < busy["num_total_blocks"]

    canceled = client.cancel(seq_id)
    assert canceled["status"] == "canceled" and canceled["finish_reason"] == "abort"
    # ...and at once when it drops a job.
    freed = wait_until(
        lambda: (stats := engine_stats(api.url))["num_running"] == 0 and stats["requests_aborted"] > busy["requests_aborted"]
        and stats, 5, "the worker to abort the job",
    )
    assert freed["num_free_blocks"] == freed["num_total_blocks"] and freed["num_waiting"] == 0
    time.sleep(0.5)
    after = client.result(seq_id)
    assert after["status"] == "canceled" and len(after["token_ids"]) < 900
    assert fetch(redis, seq_id).get_status() == "canceled"
    assert list(client.events(seq_id))[-1] == ("end", {"status": "canceled", "finish_reason": "abort"})
    assert 0 < redis.ttl(fetch(redis, seq_id).key) <= api.settings.result_ttl_s


def test_idempotent_resubmission_runs_once(service, client):
    _, redis, _ = service
    body = {"prompt": "only once", "max_tokens": 4, "temperature": 0}
    first = client.submit(idempotency_key="k-1", **body)["seq_id"]
    done = client.wait(first)
    again = client.submit(idempotency_key="k-1", **body)
    assert again == {"seq_id": first, "status": "finished", "result_url": again["result_url"]}
    assert client.result(first) == done and len(fetch(redis, first).results()) == 1


def test_a_plain_rq_worker_runs_the_same_jobs(service, client, model, tmp_path):
    """The fallback: `rq worker` runs worker.jobs.generate one job at a time, same result schema."""
    api, redis, _ = service
    body = {"prompt": "fallback path", "max_tokens": 9, "temperature": 0}
    batch_result = client.wait(client.submit(**body)["seq_id"])

    settings = service_settings(model, api.settings.redis_url, tmp_path, queue_name="plain-rq")
    side_api = ApiServer(settings).start()
    try:
        with Client(side_api.url) as side_client:
            seq_id = side_client.submit(**body)["seq_id"]
            rq_worker = subprocess.run(
                [os.path.join(os.path.dirname(sys.executable), "rq"), "worker", "plain-rq", "--burst",
                 "--url", settings.redis_url, "--serializer", "rq.serializers.JSONSerializer",
                 "--worker-class", "rq.worker.SimpleWorker"],
                env={**os.environ, **settings.to_env()}, cwd=REPO, capture_output=True, text=True, timeout=120,
            )
            assert rq_worker.returncode == 0, rq_worker.stderr
            plain_result = side_client.result(seq_id)
    finally:
        side_api.stop()
    assert plain_result["status"] == "finished"
    for field in ("text", "token_ids", "finish_reason", "usage"):
        assert plain_result[field] == batch_result[field]
    assert GenerationResult.model_validate(fetch(redis, seq_id).return_value()).seq_id == seq_id


def test_rq_stop_job_command_reaches_the_right_job(service, client):
    """RQ's stop-job command names one job; the batch worker stops that one and no other."""
    api, redis, _ = service
    stopped_id, other_id = (
        client.submit(prompt=prompt, max_tokens=600, ignore_eos=True)["seq_id"] for prompt in ("stop me", "not me")
    )
    wait_until(lambda: all(client.result(s)["status"] == "running" for s in (stopped_id, other_id)), 30, "both running")
    send_stop_job_command(redis, stopped_id, serializer=JSONSerializer)
    stopped = client.wait(stopped_id)
    assert stopped["status"] == "failed" and stopped["error"] == "worker.rq.batch_worker.JobStopped: stopped by request"
    assert fetch(redis, stopped_id).get_status() == "stopped"
    assert client.wait(other_id)["status"] == "finished"


def test_beam_search_returns_every_beam_best_first(service, client, model):
    from pagedq import LLM, BeamSearchParams

    body = {"prompt": "Tell me about beams", "use_beam_search": True, "beam_width": 3, "max_tokens": 6, "ignore_eos": True}
    result = client.wait(client.submit(**body)["seq_id"])
    assert result["status"] == "finished"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker's count, so float reductions happen in the same order
    try:
        offline = LLM(model=str(model), device="cpu").beam_search(
            "Tell me about beams", BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
        )[0]
    finally:
        torch.set_num_threads(threads)
    prompt_len = result["usage"]["prompt_tokens"]
    assert [b["token_ids"] for b in result["beams"]] == [s.tokens[prompt_len:] for s in offline.sequences]
    assert result["token_ids"] == result["beams"][0]["token_ids"] and result["text"] == result["beams"][0]["text"]


def test_structured_outputs_and_token_rules_through_the_queue(service, client):
    """The payload's new fields survive RQ's JSON (logit_bias keys become text and come back
    as token ids) and reach the worker's engine core; a shape that does not convert is
    refused before any job exists (422 naming the field), and the bystander's job is unharmed."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}
    bystander = client.submit(prompt="hello there", max_tokens=12, ignore_eos=True)["seq_id"]
    shaped = client.submit(prompt="a number", max_tokens=40, temperature=1.0,
                           structured_outputs={"json": schema, "disable_any_whitespace": True})["seq_id"]
    biased = client.submit(prompt="x", max_tokens=6, ignore_eos=True, logit_bias={"9": 100}, bad_words=["zz"])["seq_id"]
    refused = httpx.post(f"{client.base_url}/generate", json={"prompt": "a", "structured_outputs": {"regex": "a(b"}}, timeout=10)
    assert refused.status_code == 422 and "structured_outputs.regex" in refused.text
    result = client.wait(shaped)
    assert result["finish_reason"] == "stop" and 0 <= json.loads(result["text"])["n"] <= 99
    assert client.wait(biased)["token_ids"] == [9] * 6
    assert len(client.wait(bystander)["token_ids"]) == 12


def test_prompt_logprobs_come_back_in_the_result(service, client, model):
    from pagedq import LLM, SamplingParams

    prompt = [5, 17, 99, 3, 250, 8]
    result = client.wait(client.submit(prompt_token_ids=prompt, max_tokens=2, prompt_logprobs=2)["seq_id"])
    offline = LLM(model=str(model), device="cpu").generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0].prompt_logprobs
    assert result["prompt_logprobs"][0] is None and len(result["prompt_logprobs"]) == len(prompt)
    for served, expected in zip(result["prompt_logprobs"][1:], offline[1:]):
        assert {int(t) for t in served} == set(expected)
        for token, logprob in served.items():
            assert logprob == pytest.approx(expected[int(token)].logprob, abs=1e-4)


def test_a_worker_whose_engine_core_runs_in_its_own_process(service, model, tmp_path):
    """PAGEDQ_CORE_PROCESS with overlapped steps: the same tokens as the offline engine,
    streamed; the core process leaves with its worker."""
    api, _, _ = service
    settings = service_settings(model, api.settings.redis_url, tmp_path, queue_name="core-process",
                                core_process=True, async_scheduling=True)
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    side_api = ApiServer(settings).start()
    try:
        wait_for_worker(side_api.url)
        requests = [{"prompt_token_ids": [5 + i, 6, 7 + i], "max_tokens": 10 + i, "temperature": 0} for i in range(6)]
        with Client(side_api.url, timeout_s=60) as side_client:
            seq_ids = [side_client.submit(**body)["seq_id"] for body in requests]
            streamed = "".join(side_client.stream(seq_ids[0]))
            results = [side_client.wait(seq_id) for seq_id in seq_ids]
        assert [r["token_ids"] for r in results] == offline_greedy(model, requests)
        assert streamed == results[0]["text"]
        cores = subprocess.run(["pgrep", "-f", "-P", str(worker.process.pid), "pagedq.core.process"],
                               capture_output=True, text=True).stdout.split()
        assert len(cores) == 1, worker.log()
    finally:
        side_api.stop()
        worker.stop()
    wait_until(lambda: not os.path.exists(f"/proc/{cores[0]}"), 10, "the engine core process to leave with its worker")
