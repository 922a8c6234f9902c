"""The HTTP api against a real redis-server under real uvicorn, with no worker: input
checking (every bad request gets a 4xx with a JSON message), auth, limits, idempotency,
cancel of a queued job, and Redis going away (503, then recovery)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys

import httpx
import pytest
from redis import Redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from pagedq.redis_server import RedisServer, free_port
from tests.service_helpers import ApiServer, service_settings, wait_until

pytestmark = pytest.mark.slow
KEY = "test-key-8f3a1c"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir()


@pytest.fixture(scope="module")
def api(model, redis_server, tmp_path_factory):
    settings = service_settings(
        model, redis_server.url, tmp_path_factory.mktemp("api"), api_keys=[KEY], max_body_bytes=4096,
        max_prompt_tokens=200, queue_name="api-tests",
    )
    server = ApiServer(settings).start()
    yield server
    server.stop()


@pytest.fixture
def client(api):
    with httpx.Client(base_url=api.url, headers=AUTH, timeout=10) as client:
        yield client


def assert_error(response: httpx.Response, status: int, *fragments: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "message"}
    for fragment in fragments:
        assert fragment in body["message"], body["message"]


@pytest.mark.parametrize(
    ("body", "status", "fragments"),
    [
        ('{"prompt": "hi", ', 400, ["malformed JSON"]),
        ("[1, 2]", 422, ["dictionary"]),
        ({"prompt": 5}, 422, ["prompt"]),
        ({"prompt": "hi", "max_tokens": "7"}, 422, ["max_tokens"]),
        ({"prompt": "hi", "temprature": 0.5}, 422, ["temprature", "Extra inputs"]),
        ({"prompt": "hi", "max_tokens": -1}, 422, ["max_tokens", "greater than or equal to 1"]),
        ({"prompt": "hi", "top_p": 0}, 422, ["top_p"]),
        ({"prompt": "hi", "n": 0}, 422, ["n", "greater than or equal to 1"]),
        ({"prompt": "hi", "n": 2, "use_beam_search": True, "max_tokens": 4}, 422, ["n: not used by beam search"]),
        ({}, 422, ["exactly one of prompt, prompt_token_ids or messages"]),
        ({"prompt": "hi", "prompt_token_ids": [1]}, 422, ["exactly one"]),
        ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 422, ["exactly one"]),
        ({"messages": []}, 422, ["messages: must be non-empty"]),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 422, ["role"]),
        ({"prompt": ""}, 422, ["non-empty"]),
        ({"prompt_token_ids": [1, 512]}, 422, ["prompt_token_ids", "[0, 512)"]),
        ({"prompt": "hi", "stop_token_ids": [9999]}, 422, ["stop_token_ids", "[0, 512)"]),
        ({"prompt_token_ids": [5] * 201}, 422, ["201 tokens", "limit of 200"]),
        ({"prompt_token_ids": [5] * 100, "max_tokens": 1000}, 422, ["context length of 1024"]),
        ({"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, 422, ["min_tokens"]),
        ({"prompt": "hi", "use_beam_search": True, "temperature": 0.7}, 422, ["temperature: not used by beam search"]),
        ({"prompt": "hi", "beam_width": 3}, 422, ["beam_width", "only with use_beam_search"]),
        ({"prompt": "hi", "use_beam_search": True, "beam_width": 0}, 422, ["beam_width"]),
        ({"prompt": "hi", "use_beam_search": True, "max_tokens": None}, 422, ["max_tokens: beam search needs a bound"]),
    ],
)
def test_bad_requests_get_4xx_with_a_message(client, body, status, fragments):
    if isinstance(body, str):
        response = client.post("/generate", content=body, headers={"Content-Type": "application/json"})
    else:
        response = client.post("/generate", json=body)
    assert_error(response, status, *fragments)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_gets_415_naming_the_content_type(client, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    response = client.post("/generate", content=b'{"prompt": "hi"}', headers=headers)
    assert_error(response, 415, "the body must be JSON", f"it was {content_type or 'not given'}")
    # JSON that is not an object is still the body's own error.
    assert_error(client.post("/generate", json=[1, 2]), 422, "dictionary")


def test_oversized_bodies_get_413_declared_or_streamed(client):
    big = {"prompt": "x" * 5000}
    assert_error(client.post("/generate", json=big), 413, "larger than the limit of 4096 bytes")

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    response = client.post("/generate", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(response, 413, "larger than the limit")


def test_auth_is_required_and_keys_stay_out_of_the_logs(api, caplog):
    caplog.set_level(logging.DEBUG)
    with httpx.Client(base_url=api.url, timeout=10) as anonymous:
        assert_error(anonymous.post("/generate", json={"prompt": "hi"}), 401, "missing API key")
        wrong = {"Authorization": "Bearer not-the-key"}
        assert_error(anonymous.post("/generate", json={"prompt": "hi"}, headers=wrong), 401, "invalid API key")
        assert_error(anonymous.get("/result/abc", headers=wrong), 401)
        assert_error(anonymous.delete("/result/abc", headers={"Authorization": "Basic x"}), 401)
        assert_error(anonymous.get("/stream/abc"), 401)
        # Liveness and readiness need no key.
        assert anonymous.get("/health").json() == {"status": "ok"}
        assert anonymous.get("/docs").status_code == 200
        accepted = anonymous.post("/generate", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH)
        assert accepted.status_code == 202
    assert "not-the-key" not in caplog.text and KEY not in caplog.text
    assert "POST /generate" in caplog.text  # the access log was captured


def test_v1_needs_a_key_too_and_answers_in_openai_shape(api):
    with httpx.Client(base_url=api.url, timeout=10) as anonymous:
        for response in (
            anonymous.get("/v1/models"),
            anonymous.post("/v1/completions", json={"model": "m", "prompt": "hi"}),
            anonymous.post("/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "batch"}),
            anonymous.get("/v1/batches", headers={"Authorization": "Bearer not-the-key"}),
        ):
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
        assert anonymous.get("/v1/models", headers=AUTH).status_code == 200
        # A body over PAGEDQ_MAX_BODY_BYTES on /v1: 413, OpenAI-shaped.
        big = anonymous.post("/v1/completions", json={"model": "m", "prompt": "x" * 5000}, headers=AUTH)
        assert big.status_code == 413 and "larger than the limit" in big.json()["error"]["message"]
        assert anonymous.get("/metrics").status_code == 200  # scrapers need no key


def test_submit_answers_202_and_the_job_waits_queued(client, api, redis_server):
    response = client.post("/generate", json={"prompt": "Hello there", "max_tokens": 5, "temperature": 0})
    assert response.status_code == 202
    submitted = response.json()
    seq_id = submitted["seq_id"]
    assert submitted["status"] == "queued"
    assert submitted["result_url"] == f"{api.url}/result/{seq_id}"

    result = client.get(f"/result/{seq_id}").json()
    assert result["status"] == "queued" and result["text"] == "" and result["timings"]["enqueued"] > 0
    # The job is an RQ job with the JSON serializer, its function named by dotted path.
    job = Job.fetch(seq_id, connection=Redis.from_url(redis_server.url), serializer=JSONSerializer)
    assert job.func_name == "worker.jobs.generate"
    assert job.kwargs["sampling"]["max_tokens"] == 5 and job.kwargs["prompt"] == "Hello there"
    # A long poll on a job that does not end returns its state when the wait is over.
    assert client.get(f"/result/{seq_id}", params={"wait": 0.3}).json()["status"] == "queued"


def test_messages_are_queued_through_the_chat_template(client, model, redis_server):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    seq_id = client.post("/generate", json={"messages": messages, "max_tokens": 5}).json()["seq_id"]
    job = Job.fetch(seq_id, connection=Redis.from_url(redis_server.url), serializer=JSONSerializer)
    templated = AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert job.kwargs["prompt_token_ids"] == list(templated)
    client.delete(f"/result/{seq_id}")


def test_docs_load_only_local_assets_and_offer_bearer_auth(api):
    with httpx.Client(base_url=api.url, timeout=10) as anonymous:
        for page in ("/docs", "/redoc"):
            html = anonymous.get(page)
            assert html.status_code == 200
            assets = re.findall(r'(?:src|href|spec-url)="([^"]+)"', html.text) + re.findall(r"url: '([^']+)'", html.text)
            assert any(asset.endswith(".js") for asset in assets), html.text
            assert "http://" not in html.text and "https://" not in html.text, f"{page} loads something from elsewhere"
            for asset in assets:
                loaded = anonymous.get(asset)
                assert loaded.status_code == 200 and len(loaded.content) > 500, asset
        schema = anonymous.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["HTTPBearer"] | {"description": None} == {
        "type": "http", "scheme": "bearer", "description": None,
    }
    for path, method in [("/generate", "post"), ("/v1/completions", "post"), ("/v1/files", "post")]:
        assert {"HTTPBearer": []} in schema["paths"][path][method]["security"], path


def test_docs_render_in_a_browser_for_users_with_typed_examples(api, tmp_path):
    """/redoc and /docs as a user's browser shows them (headless Chromium runs their
    scripts): an introduction for users, not developer notes, and every route's response
    typed with an example (Redoc's sample for GET /v1/models once was `{}`)."""
    schema = httpx.get(f"{api.url}/openapi.json", timeout=10).json()
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            ok = next(response for code, response in operation["responses"].items() if code.startswith("2"))
            assert operation.get("description"), (method, path)
            assert any("example" in media or "examples" in media for media in ok["content"].values()), (method, path)
            typed = ok["content"].get("application/json", {}).get("schema", {})
            assert "application/json" not in ok["content"] or "$ref" in typed or "properties" in typed, (method, path)
    chromium = next((found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))),
                    None)
    if chromium is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    # Redoc shows every response sample (the model list's carries max_model_len); Swagger UI
    # lists the routes by their summaries.
    for page, rendered in (("/redoc", "max_model_len"), ("/docs", "Create a completion")):
        dom = subprocess.run(
            [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / page[1:]}",
             "--virtual-time-budget=15000", "--dump-dom", f"{api.url}{page}"],
            capture_output=True, text=True, timeout=90).stdout
        assert rendered in dom and "Two ways in" in dom, page
        for developer_note in ("create_app", "native_routes.py", "openai_compat.py"):
            assert developer_note not in dom, (page, developer_note)


def test_cancel_a_queued_job(client, redis_server):
    seq_id = client.post("/generate", json={"prompt": "cancel me"}).json()["seq_id"]
    queue = Queue("api-tests", connection=Redis.from_url(redis_server.url), serializer=JSONSerializer)
    assert seq_id in queue.job_ids
    canceled = client.delete(f"/result/{seq_id}")
    assert canceled.status_code == 200 and canceled.json()["status"] == "canceled"
    assert seq_id not in queue.job_ids  # no worker will ever take it
    assert client.get(f"/result/{seq_id}").json()["status"] == "canceled"
    assert client.delete(f"/result/{seq_id}").json()["status"] == "canceled"  # idempotent
    # The stream of a canceled job ends at once.
    events = client.get(f"/stream/{seq_id}").text
    assert "event: end" in events and '"status": "canceled"' in events


def test_unknown_ids_get_404(client):
    for seq_id in ("0123456789abcdef", "bad%20id"):
        assert_error(client.get(f"/result/{seq_id}"), 404, "no job")
        assert_error(client.delete(f"/result/{seq_id}"), 404, "no job")
        assert_error(client.get(f"/stream/{seq_id}"), 404, "no job")
    assert_error(client.get("/result/abc", params={"wait": -1}), 422, "wait")
    assert_error(client.get("/stream/abc", headers={"Last-Event-ID": "x"}), 400, "Last-Event-ID")


def test_idempotency_key_gives_one_job(client, redis_server):
    body = {"prompt": "once", "max_tokens": 3}
    first = client.post("/generate", json=body, headers={"Idempotency-Key": "order-17"})
    again = client.post("/generate", json=body, headers={"Idempotency-Key": "order-17"})
    assert first.status_code == again.status_code == 202
    assert first.json()["seq_id"] == again.json()["seq_id"]
    queue = Queue("api-tests", connection=Redis.from_url(redis_server.url), serializer=JSONSerializer)
    assert queue.job_ids.count(first.json()["seq_id"]) == 1
    other = client.post("/generate", json={**body, "max_tokens": 4}, headers={"Idempotency-Key": "order-17"})
    assert_error(other, 422, "already used with a different request body")
    assert_error(client.post("/generate", json=body, headers={"Idempotency-Key": "has space"}), 400, "Idempotency-Key")


def test_ready_is_503_without_a_worker(client):
    assert_error(client.get("/ready"), 503, "no live worker on queue 'api-tests'")


def test_queue_over_its_limit_gets_429_with_retry_after(model, redis_server, tmp_path):
    settings = service_settings(model, redis_server.url, tmp_path, queue_name="tiny-queue", max_queue_depth=2,
                                retry_after_s=7)
    server = ApiServer(settings).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for _ in range(2):
                assert client.post("/generate", json={"prompt": "hi"}).status_code == 202
            full = client.post("/generate", json={"prompt": "hi"})
            assert_error(full, 429, "queue is full (2 jobs waiting)")
            assert full.headers["Retry-After"] == "7"
    finally:
        server.stop()


def test_a_completion_whose_prompts_do_not_all_fit_queues_none_of_them(model, redis_server, tmp_path):
    """Several prompts in one /v1/completions request are queued together (one round trip):
    room for two of three answers 429 and cancels the two queued, so nothing runs for an
    answer the client never got; the queue has its room back."""
    settings = service_settings(model, redis_server.url, tmp_path, queue_name="openai-room", max_queue_depth=2)
    server = ApiServer(settings).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            response = client.post("/v1/completions", json={"model": str(model), "prompt": ["a", "b", "c"], "max_tokens": 2})
            assert response.status_code == 429, response.text
            assert "queue is full" in response.json()["error"]["message"]
            assert Queue("openai-room", connection=Redis.from_url(redis_server.url)).count == 0
            assert client.post("/generate", json={"prompt": "after"}).status_code == 202
    finally:
        server.stop()


def test_generation_config_sets_the_defaults_of_omitted_sampling_fields(model, redis_server, tmp_path):
    """As vLLM's default `--generation-config auto`: the checkpoint's temperature, top_p,
    top_k, min_p, repetition_penalty apply where a request leaves them out."""
    checkpoint = tmp_path / "model"
    shutil.copytree(model, checkpoint)
    config = json.loads((checkpoint / "generation_config.json").read_text())
    (checkpoint / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "temperature": 0.3, "top_k": 7}))
    settings = service_settings(checkpoint, redis_server.url, tmp_path, queue_name="defaults-queue")
    server = ApiServer(settings).start()
    connection = Redis.from_url(redis_server.url)

    def sampling(path: str, body: dict) -> dict:
        if path == "/generate":
            seq_id = client.post(path, json=body).json()["seq_id"]
        else:  # not waited for: its job is read while queued
            with pytest.raises(httpx.ReadTimeout):
                client.post(path, json={"model": "model", **body}, timeout=0.5)
            seq_id = Queue("defaults-queue", connection=connection).job_ids[-1]
        return Job.fetch(seq_id, connection=connection, serializer=JSONSerializer).kwargs["sampling"]

    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for path in ("/generate", "/v1/completions"):
                omitted = sampling(path, {"prompt": "hi"})
                assert (omitted["temperature"], omitted["top_k"], omitted["top_p"]) == (0.3, 7, 1.0), path
                given = sampling(path, {"prompt": "hi", "temperature": 0})
                assert (given["temperature"], given["top_k"]) == (0.0, 7), path
    finally:
        server.stop()


def test_queue_depth_limit_is_exact_under_concurrent_submits(model, redis_server, tmp_path):
    """The depth check and the enqueue are one atomic step: 400 submits at once, spread over
    three api servers, against room for 100 accept exactly 100 (checking, then enqueueing,
    let 101-103 in)."""
    settings = service_settings(model, redis_server.url, tmp_path, queue_name="exact-queue", max_queue_depth=100)
    servers = [ApiServer(settings.with_overrides(port=free_port())).start() for _ in range(3)]

    async def submit_all() -> list[int]:
        clients = [httpx.AsyncClient(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=400))
                   for server in servers]
        try:
            responses = await asyncio.gather(
                *(clients[i % 3].post("/generate", json={"prompt": f"p{i}"}) for i in range(400))
            )
        finally:
            for client in clients:
                await client.aclose()
        return [response.status_code for response in responses]

    try:
        statuses = asyncio.run(submit_all())
        assert (statuses.count(202), statuses.count(429)) == (100, 300)
        assert Queue("exact-queue", connection=Redis.from_url(redis_server.url)).count == 100
    finally:
        for server in servers:
            server.stop()


def test_redis_going_away_gives_503_then_recovers(model, tmp_path):
    redis_server = RedisServer(tmp_path / "redis").start()
    server = ApiServer(service_settings(model, redis_server.url, tmp_path, queue_name="outage")).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            seq_id = client.post("/generate", json={"prompt": "survives"}).json()["seq_id"]
            redis_server.stop()
            for response in (
                client.post("/generate", json={"prompt": "hi"}),
                client.get(f"/result/{seq_id}"),
                client.get(f"/result/{seq_id}", params={"wait": 1}),
                client.delete(f"/result/{seq_id}"),
                client.get(f"/stream/{seq_id}"),
                client.get("/ready"),
            ):
                assert_error(response, 503, "the job store (Redis) is unreachable")
                assert response.headers["Retry-After"]
            assert client.get("/health").status_code == 200  # alive, just not ready

            redis_server.start()  # same port and data directory: the AOF brings the job back
            assert client.get(f"/result/{seq_id}").json()["status"] == "queued"
            assert client.post("/generate", json={"prompt": "hi"}).status_code == 202
    finally:
        server.stop()
        redis_server.stop()


def test_more_concurrent_requests_than_redis_connections_wait_for_one(model, redis_server, tmp_path):
    """A burst wider than the api's Redis pool queues for connections instead of failing:
    redis-py's default pool answers the command past its limit with "Too many connections",
    which the api would turn into 503s (seen with a few hundred open streams)."""
    settings = service_settings(model, redis_server.url, tmp_path, queue_name="narrow-pool", redis_max_connections=3)
    server = ApiServer(settings).start()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            submitted = await asyncio.gather(*(client.post("/generate", json={"prompt": f"job {i}"}) for i in range(40)))
            assert [r.status_code for r in submitted] == [202] * 40, [r.text for r in submitted if r.status_code != 202]
            seq_ids = [r.json()["seq_id"] for r in submitted]
            await asyncio.gather(*(client.delete(f"/result/{seq_id}") for seq_id in seq_ids))
            return await asyncio.gather(
                *(client.get(f"/stream/{seq_id}") for seq_id in seq_ids),
                *(client.get(f"/result/{seq_id}", params={"wait": 1}) for seq_id in seq_ids),
            )

    try:
        responses = asyncio.run(burst())
    finally:
        server.stop()
    assert [r.status_code for r in responses] == [200] * 80, {r.status_code: r.text for r in responses}
    streams, results = responses[:40], responses[40:]
    assert all('"status": "canceled"' in r.text for r in streams)
    assert all(r.json()["status"] == "canceled" for r in results)


def test_api_workers_share_a_port_sum_metrics_and_stop_on_sigterm(model, redis_server, tmp_path):
    """`pagedq api --workers 2`: two uvicorn worker processes behind one port; /metrics
    from either counts every process's requests; SIGTERM stops them all cleanly."""
    settings = service_settings(model, redis_server.url, tmp_path, queue_name="two-apis")
    env = {**os.environ, **settings.to_env()}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with open(tmp_path / "api.log", "wb") as log:
        api = subprocess.Popen([sys.executable, "-m", "pagedq.cli", "api", "--workers", "2"], env=env,
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{settings.port}"
    try:
        log = tmp_path / "api.log"
        wait_until(lambda: log.read_text().count("Application startup complete") == 2, 120, "both api processes to start",
                   interval_s=0.2)
        # Twenty connections held open, each served by the process that accepted it (the
        # kernel spreads them); each submits once, then each scrapes: whichever process
        # answers, it counts every process's submits.
        clients = [httpx.Client(base_url=url, timeout=10) for _ in range(20)]
        try:
            for i, client in enumerate(clients):
                assert client.post("/generate", json={"prompt": f"p{i}"}).status_code == 202
            scrapes = ['pagedq:jobs_submitted_total{queue="two-apis"} 20.0' in client.get("/metrics").text
                       for client in clients]
        finally:
            for client in clients:
                client.close()
        assert scrapes == [True] * 20
        # uvicorn's access log is on by default, as vLLM's is.
        assert log.read_text().count('"POST /generate HTTP/1.1" 202') == 20
        api.send_signal(signal.SIGTERM)
        assert api.wait(30) == 0
        assert log.read_text().count("Application shutdown complete") == 2
    finally:
        if api.poll() is None:
            api.kill()
            api.wait()



def test_disable_uvicorn_access_log_leaves_requests_unlogged(model, redis_server, tmp_path):
    """`pagedq api --disable-uvicorn-access-log` (vLLM's flag): requests are served and
    none is logged; uvicorn's other lines still are."""
    settings = service_settings(model, redis_server.url, tmp_path, queue_name="quiet-api")
    env = {**os.environ, **settings.to_env()}
    log_path = tmp_path / "api.log"
    with open(log_path, "wb") as log:
        api = subprocess.Popen([sys.executable, "-m", "pagedq.cli", "api", "--workers", "1", "--disable-uvicorn-access-log"],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "Application startup complete" in log_path.read_text(), 120, "the api to start", interval_s=0.2)
        with httpx.Client(base_url=f"http://127.0.0.1:{settings.port}", timeout=10) as client:
            assert client.post("/generate", json={"prompt": "hi"}).status_code == 202
            assert client.get("/health").status_code == 200
        api.send_signal(signal.SIGTERM)
        # One uvicorn process raises the signal again once it has shut down.
        assert api.wait(30) in (0, -signal.SIGTERM)
    finally:
        if api.poll() is None:
            api.kill()
            api.wait()
    text = log_path.read_text()
    assert "Application shutdown complete" in text
    assert "/generate" not in text and "/health" not in text, text


def test_a_stream_redis_cannot_read_ends_with_an_error_frame(client, redis_server):
    """The stream says why it stops before its end (and the job goes on): an `error` frame
    asking the client to reconnect, never a silent close."""
    from pagedq.redis_schema import stream_key

    seq_id = client.post("/generate", json={"prompt": "hi", "max_tokens": 4}).json()["seq_id"]
    Redis.from_url(redis_server.url).set(stream_key(seq_id), "not a stream")  # every read of it is refused
    with client.stream("GET", f"/stream/{seq_id}") as response:
        body = response.read().decode()
    assert response.status_code == 200
    frames = [frame for frame in body.split("\n\n") if frame]
    assert frames[-1].startswith("event: error") and "reconnect with Last-Event-ID" in frames[-1]
    assert client.get(f"/result/{seq_id}").json()["status"] == "queued"
