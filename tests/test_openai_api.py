"""The OpenAI-compatible endpoints and /metrics, driven by the official `openai` package
against a real redis-server, the api under uvicorn and a `pagedq worker` process. Greedy
results are checked against pagedq's offline engine on the same prompts."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer
from transformers import AutoTokenizer

from pagedq.client import Client
from pagedq.redis_schema import stream_key
from pagedq.redis_server import RedisServer
from tests.service_helpers import (
    ApiServer,
    WorkerProcess,
    offline_greedy,
    offline_outputs,
    service_settings,
    wait_for_worker,
    wait_until,
)

pytestmark = pytest.mark.slow
QUEUE = "oai"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir()


@pytest.fixture(scope="module")
def service(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oai")
    redis_server = RedisServer(tmp / "redis").start()
    settings = service_settings(model, redis_server.url, tmp, queue_name=QUEUE, metrics_port=0)
    worker = WorkerProcess(settings, tmp / "worker.log")
    api = ApiServer(settings).start()
    try:
        wait_for_worker(api.url)
        yield api, Redis.from_url(redis_server.url)
    finally:
        api.stop()
        worker.stop()
        redis_server.stop()


@pytest.fixture
def client(service):
    api, _ = service
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=60)


def job_of(redis: Redis, response_id: str) -> Job:
    """The RQ job behind a response: ids are `cmpl-<seq_id>` / `chatcmpl-<seq_id>`."""
    return Job.fetch(response_id.split("-", 1)[1], connection=redis, serializer=JSONSerializer)


def test_models_lists_the_checkpoint_by_its_directory_name(client, model):
    (card,) = client.models.list().data
    assert card.id == model.name and card.owned_by == "pagedq"
    assert client.models.retrieve(model.name).id == model.name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completions_match_the_offline_engine_streamed_or_not(service, client, model):
    _, redis = service
    body = {"prompt": "The quick brown fox", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    (expected,) = offline_greedy(model, [body])

    completion = client.completions.create(model=model.name, prompt=body["prompt"], max_tokens=9, temperature=0,
                                           extra_body={"ignore_eos": True})
    (choice,) = completion.choices
    assert completion.object == "text_completion" and completion.model == model.name
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 9 and completion.usage.total_tokens == completion.usage.prompt_tokens + 9
    job = job_of(redis, completion.id)
    assert job.return_value()["token_ids"] == expected and choice.text == job.return_value()["text"]
    assert job.kwargs["prompt"] == body["prompt"]  # the same job POST /generate enqueues
    # Nobody streamed it: its deltas were its partial result, dropped once its result was in.
    assert [fields[b"type"] for _, fields in redis.xrange(stream_key(job.id))] == [b"end"]

    # The full path of the checkpoint names the same model; token ids are a prompt too.
    by_ids = client.completions.create(model=str(model), prompt=job.kwargs["prompt_token_ids"], max_tokens=9,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == choice.text

    chunks = list(client.completions.create(model=model.name, prompt=body["prompt"], max_tokens=9, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    # In pieces: the first token's chunk, then the rest (the worker sends every token made
    # while a Redis round trip is out as one delta, so a fast engine's 9 tokens can come in
    # as few as two chunks).
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1]) and len(chunks) >= 2


def test_n_choices_from_one_job_streamed_or_not(service, client, model):
    _, redis = service
    sampling = {"n": 2, "temperature": 0.8, "seed": 5, "max_tokens": 6}
    completion = client.completions.create(model=model.name, prompt="Pick a number", logprobs=1,
                                           extra_body={"ignore_eos": True}, **sampling)
    job = job_of(redis, completion.id)
    (expected,) = offline_outputs(model, [{"prompt_token_ids": job.kwargs["prompt_token_ids"], "ignore_eos": True,
                                           "logprobs": 1, **sampling}])
    assert [c.index for c in completion.choices] == [0, 1]
    assert [c["token_ids"] for c in job.return_value()["completions"]] == expected and expected[0] != expected[1]
    assert [c.text for c in completion.choices] == [c["text"] for c in job.return_value()["completions"]]
    assert all(len(c.logprobs.tokens) == 6 for c in completion.choices)
    assert completion.usage.completion_tokens == 12

    chunks = list(client.completions.create(model=model.name, prompt="Pick a number", stream=True,
                                            extra_body={"ignore_eos": True}, **sampling))
    for choice in completion.choices:  # seeded: the stream carries the same two samples
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(part.text for part in mine) == choice.text and mine[-1].finish_reason == "length"

    chat = client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "Hi"}], **sampling)
    streamed = list(client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "Hi"}],
                                                   stream=True, **sampling))
    assert [c.index for c in chat.choices] == [0, 1]
    for choice in chat.choices:
        mine = [c.choices[0] for c in streamed if c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(part.delta.content or "" for part in mine) == choice.message.content


def test_chat_uses_the_checkpoint_chat_template(service, client, model):
    _, redis = service
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    template_ids = list(AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    (expected,) = offline_greedy(model, [{"prompt_token_ids": template_ids, "max_tokens": 8, "temperature": 0,
                                          "ignore_eos": True}])

    chat = client.chat.completions.create(model=model.name, messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    (choice,) = chat.choices
    job = job_of(redis, chat.id)
    assert job.kwargs["prompt_token_ids"] == template_ids and chat.usage.prompt_tokens == len(template_ids)
    assert job.return_value()["token_ids"] == expected
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == job.return_value()["text"] and choice.finish_reason == "length"
    # Greedy: every chosen token is its step's best alternative.
    assert len(choice.logprobs.content) == 8
    for step in choice.logprobs.content:
        assert len(step.top_logprobs) == 3 and step.top_logprobs[0].token == step.token
        assert step.logprob == step.top_logprobs[0].logprob >= step.top_logprobs[1].logprob
    assert "".join(step.token for step in choice.logprobs.content) == choice.message.content

    stream = list(client.chat.completions.create(
        model=model.name, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == choice.message.content
    assert stream[-2].choices[0].finish_reason == "length"
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 8


def test_a_finished_stream_ends_from_its_end_event_without_reading_the_job(service, client, model, monkeypatch):
    """A finished job's stream "end" says how each of its outputs ended (finish_reason,
    stop_reason, tokens): a stream's last chunks and its usage come from that, with no read
    of the job (its hash, payload and result: the api's largest cost per streamed request
    after the submission itself). Failed and canceled jobs are still read, for their error."""
    from api.jobs import JobStore

    async def read_job(*args, **kwargs):
        raise AssertionError("the job was read")

    monkeypatch.setattr(JobStore, "outcome", read_job)
    stream = list(client.completions.create(
        model=model.name, prompt="Count", max_tokens=6, n=2, temperature=1.0, seed=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    ends = {chunk.choices[0].index: chunk.choices[0].finish_reason for chunk in stream
            if chunk.choices and chunk.choices[0].finish_reason}
    assert ends == {0: "length", 1: "length"}
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 12


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "fragment"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model", "The model `nope` does not exist"),
        ("/v1/completions", {"model": "M", "prompt": "hi", "n": 0}, 400, "n", "greater than or equal to 1"),
        ("/v1/completions", {"model": "M", "prompt": "hi", "best_of": 3}, 400, "best_of", "best_of: not supported"),
        ("/v1/completions", {"model": "M", "prompt": ["a", ""]}, 400, "prompt", "every prompt must be non-empty"),
        ("/v1/completions", {"model": "M", "prompt": "hi", "suffixx": "x"}, 400, "suffixx", "Extra inputs"),
        ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "greater than or equal"),
        ("/v1/completions", {"model": "M", "prompt": "hi " * 400, "max_tokens": 900}, 400, "max_tokens", "context length"),
        ("/v1/completions", {"model": "M", "prompt": "hi " * 600}, 400, "prompt", "prompt and at least one output token"),
        ("/v1/completions", {"model": "M", "prompt": [1, 99999]}, 400, "prompt_token_ids", "[0, 512)"),
        ("/v1/completions", {"model": "M", "prompt": "hi", "suffix": "x"}, 400, "suffix", "suffix: not supported"),
        ("/v1/completions", {"model": "M", "prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias", "[0, 512)"),
        ("/v1/completions", {"model": "M", "prompt": "hi", "structured_outputs": {"regex": "[a-"}}, 400,
         "structured_outputs", "structured_outputs.regex: Regex parsing error"),
        ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integr"}}}}, 400,
         "response_format.json_schema.schema", "Unsupported type"),
        ("/v1/completions", {"model": "M", "prompt": "hi", "stream": True, "stream_options": {"usage": True}}, 400,
         "stream_options.usage", "Extra inputs"),
        ("/v1/completions", {"model": "M"}, 400, "prompt", "Field required"),
        ("/v1/completions", {"model": "M", "prompt": "hi", "use_beam_search": True, "prompt_logprobs": 1,
                             "max_tokens": 3}, 400, "prompt_logprobs", "not available with use_beam_search"),
        ("/v1/completions", {"model": "M", "prompt": "hi", "use_beam_search": True, "n": 2, "length_penalty": 1e300},
         400, "length_penalty", "less than or equal to 10"),
        # Errors name the fields the client sent, in one line: a Response's, not the chat's it is served as.
        ("/v1/responses", {"model": "M", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                          "schema": {"type": "nope"}}}},
         400, "text.format.schema", "text.format.schema: "),
        ("/v1/responses", {"model": "M", "input": "hi " * 400, "max_output_tokens": 900}, 400, "max_output_tokens",
         "max_output_tokens: "),
        ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
                                  "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(1100)]},
         400, "tools", 'tools: with tool_choice "required", structured_outputs.json: anyOf has 1100 entries'),
        # Beam search's width is `n` on the OpenAI routes: its errors name `n`, not the native beam_width.
        ("/v1/completions", {"model": "M", "prompt": "hi", "use_beam_search": True, "n": 256}, 400, "n",
         "n: Input should be less than or equal to 64"),
        ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "use_beam_search": True,
                                  "n": 65, "max_tokens": 5}, 400, "n", "n: Input should be less than or equal to 64"),
        ("/v1/completions", {"model": "M", "prompt": "hi", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens",
         "min_tokens: must be at most max_tokens (9 > 3)"),
        ("/v1/chat/completions", {"model": "M", "messages": []}, 400, "messages", "at least 1"),
        ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "functions": []}, 400,
         "functions", "Extra inputs"),
        ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content", "text"),
    ],
)
def test_bad_requests_get_openai_shaped_errors(service, model, path, body, status, param, fragment):
    api, _ = service
    if body.get("model") == "M":
        body = {**body, "model": model.name}
    response = httpx.post(f"{api.url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    # Every message names its field first, never pydantic's "Value error, " (and `param` names it too).
    assert fragment in error["message"] and "Value error" not in error["message"]
    assert "\n" not in error["message"] and "pydantic.dev" not in error["message"]  # one line, not pydantic's dump
    assert error["param"] is not None and error["param"].startswith(param)


def test_openai_client_raises_its_own_errors_and_generate_keeps_its_shape(service, client, model):
    api, _ = service
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="suffix: not supported"):
        client.completions.create(model=model.name, prompt="hi", suffix="!")
    malformed = httpx.post(f"{api.url}/v1/completions", content=b"{", headers={"Content-Type": "application/json"})
    assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]["message"]
    # POST /generate still answers its own shape.
    legacy = httpx.post(f"{api.url}/generate", json={"prompt": "hi", "n": 0})
    assert legacy.status_code == 422 and set(legacy.json()) == {"error", "message"}


def test_a_non_streaming_request_past_its_timeout_gets_504_and_its_job_is_canceled(model, service, tmp_path):
    """An api whose queue has no worker: the request times out and leaves no work behind."""
    api, redis = service
    settings = service_settings(model, api.settings.redis_url, tmp_path, queue_name="no-worker", completion_timeout_s=1)
    lonely = ApiServer(settings).start()
    try:
        started = time.monotonic()
        response = httpx.post(f"{lonely.url}/v1/completions", json={"model": model.name, "prompt": "hi"}, timeout=30)
        assert 1 <= time.monotonic() - started < 10
    finally:
        lonely.stop()
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["code"] == "timeout" and "PAGEDQ_COMPLETION_TIMEOUT_S" in error["message"]
    seq_id = error["message"].split()[1]
    assert Job.fetch(seq_id, connection=redis, serializer=JSONSerializer).get_status() == "canceled"


def test_a_client_that_disconnects_from_a_stream_cancels_its_job(service, model):
    api, redis = service
    body = {"model": model.name, "prompt": "go on and on", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{api.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
    seq_id = first.split('"id": "cmpl-', 1)[1].split('"', 1)[0]
    job = wait_until(lambda: (j := Job.fetch(seq_id, connection=redis, serializer=JSONSerializer)).get_status()
                     == "canceled" and j, 10, "the job to be canceled")
    assert len(job.meta.get("progress", {}).get("token_ids", [])) < 900


def _stream_texts(events: str) -> tuple[set[str], str]:
    """The ids and the joined text of an SSE completion stream's chunks."""
    chunks = [json.loads(line.removeprefix("data: ")) for line in events.splitlines()
              if line.startswith("data: {")]
    return {chunk["id"] for chunk in chunks}, "".join(c["text"] for chunk in chunks for c in chunk["choices"])


def test_a_job_nobody_streamed_streams_whole_once_finished(service, model):
    """An unstreamed request's job keeps no deltas once it finishes (its result holds the
    text), so GET /stream of it sent only `end`: now the text, with its logprobs, comes from
    the result before the end."""
    api, _ = service
    answer = httpx.post(f"{api.url}/v1/completions", timeout=60, json={
        "model": model.name, "prompt": "hello", "max_tokens": 8, "temperature": 0, "logprobs": 1}).json()
    (choice,) = answer["choices"]
    seq_id = answer["id"].removeprefix("cmpl-")
    client = Client(api.url)
    try:
        events = list(client.events(seq_id))
    finally:
        client.close()
    deltas = [data for kind, data in events if kind == "delta"]
    assert "".join(delta["text"] for delta in deltas) == choice["text"] and choice["text"]
    assert deltas[-1]["num_tokens"] == 8
    assert [step for delta in deltas for step in delta["logprobs"]] and \
        [lp for delta in deltas for _, step in delta["logprobs"] for lp in step.values()] == \
        choice["logprobs"]["token_logprobs"]
    assert events[-1] == ("end", {"status": "finished", "finish_reason": "length"})


def test_an_idempotency_key_makes_a_retry_follow_the_same_jobs(service, model):
    """With an Idempotency-Key, a retried /v1 request answers from the jobs the first one
    queued (one per prompt of a list); the key with another body is a 422; a stream its
    client drops leaves its job running, and the retry streams that job whole."""
    api, redis = service
    url = f"{api.url}/v1/completions"
    body = {"model": model.name, "prompt": ["one", "two"], "max_tokens": 6, "temperature": 1.0}
    first = httpx.post(url, json=body, headers={"Idempotency-Key": "retry-1"}, timeout=60).json()
    again = httpx.post(url, json=body, headers={"Idempotency-Key": "retry-1"}, timeout=60).json()
    assert (again["id"], again["choices"]) == (first["id"], first["choices"])
    assert httpx.post(url, json=body, timeout=60).json()["id"] != first["id"]  # no key: new jobs
    # Another body with the key, a prompt list shorter, longer or changed included, is a 422
    # that leaves the first request's jobs alone; whether it streams is not the body's.
    for other_body in ({**body, "max_tokens": 7}, {**body, "prompt": ["one"]}, {**body, "prompt": ["one", "two", "3"]},
                       {**body, "prompt": ["one", "2"]}):
        other = httpx.post(url, json=other_body, headers={"Idempotency-Key": "retry-1"}, timeout=60)
        assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_conflict", other_body
    after = httpx.post(url, json=body, headers={"Idempotency-Key": "retry-1"}, timeout=60).json()
    assert (after["id"], after["choices"]) == (first["id"], first["choices"])
    # The streamed retry of the finished jobs (nobody streamed them: their streams lost their
    # deltas when they finished) has their whole text all the same; it had none.
    replay = httpx.post(url, json={**body, "stream": True}, headers={"Idempotency-Key": "retry-1"}, timeout=60).text
    ids, _ = _stream_texts(replay)
    assert ids == {first["id"]}
    texts = ["", ""]
    for line in replay.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                texts[choice["index"]] += choice["text"]
    assert texts == [choice["text"] for choice in first["choices"]] and all(texts)
    # A Response's key is its own, not a chat's with the same key.
    chat = httpx.post(f"{api.url}/v1/chat/completions", headers={"Idempotency-Key": "retry-3"}, timeout=60,
                      json={"model": model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    response = httpx.post(f"{api.url}/v1/responses", headers={"Idempotency-Key": "retry-3"}, timeout=60,
                          json={"model": model.name, "input": "hi", "max_output_tokens": 3})
    assert response.status_code == 200 and chat.json()["id"].removeprefix("chatcmpl-") not in response.json()["id"]
    bad = httpx.post(url, json=body, headers={"Idempotency-Key": "two words"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Idempotency-Key"

    streamed = {"model": model.name, "prompt": "go on", "max_tokens": 300, "ignore_eos": True, "temperature": 0,
                "stream": True}
    headers = {"Idempotency-Key": "retry-2"}
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=streamed, headers=headers) as response:
        first_line = next(line for line in response.iter_lines() if line.startswith("data: {"))
    seq_id = json.loads(first_line.removeprefix("data: "))["id"].removeprefix("cmpl-")
    time.sleep(1.0)  # a dropped stream without a key is canceled by now
    assert Job.fetch(seq_id, connection=redis, serializer=JSONSerializer).get_status() != "canceled"
    ids, text = _stream_texts(httpx.post(url, json=streamed, headers=headers, timeout=120).text)
    assert ids == {f"cmpl-{seq_id}"}
    assert text == httpx.post(url, json={**streamed, "stream": False}, timeout=120).json()["choices"][0]["text"]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page, parsed by prometheus-client's own parser."""
    text = httpx.get(url, timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_parse_and_move_as_requests_run(service, client, model):
    api, _ = service
    (worker,) = httpx.get(f"{api.url}/ready").json()["workers"]
    worker_url, api_url = f"http://127.0.0.1:{worker['metrics_port']}/metrics", f"{api.url}/metrics"
    vllm_labels = (("engine", "0"), ("model_name", model.name))
    # The engine core reports its counters with each message: once it shows nothing running,
    # the steps of the jobs earlier tests canceled are all counted (the worker reads its
    # stats again with each heartbeat while idle).
    before = wait_until(lambda: (m := scrape(worker_url))[("pagedq:num_requests_running", vllm_labels)] == 0 and m,
                        10, "the worker's metrics to settle")
    api_before = scrape(api_url)

    client.completions.create(model=model.name, prompt="count the tokens", max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    after = wait_until(lambda: (m := scrape(worker_url))[("pagedq:jobs_finished_total", ())]
                       > before[("pagedq:jobs_finished_total", ())] and m, 10, "the worker's metrics")
    api_after = scrape(api_url)

    def moved(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before[(name, labels)]

    # vLLM's metrics carry vLLM's labels, so its Grafana dashboard can select the model.
    assert moved("pagedq:jobs_finished_total") == 1 and moved("pagedq:jobs_failed_total") == 0
    assert moved("pagedq:generation_tokens_total", vllm_labels) == 7
    assert moved("pagedq:prompt_tokens_total", vllm_labels) > 0
    assert moved("pagedq:prefix_cache_queries_total", vllm_labels) >= 0
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                      "request_decode_time", "request_inference_time"):
        assert moved(f"pagedq:{histogram}_seconds_count", vllm_labels) == 1
        assert moved(f"pagedq:{histogram}_seconds_sum", vllm_labels) > 0
    assert moved("pagedq:inter_token_latency_seconds_count", vllm_labels) == 6  # 7 tokens, 6 gaps
    assert moved("pagedq:request_generation_tokens_sum", vllm_labels) == 7
    assert moved("pagedq:request_params_max_tokens_sum", vllm_labels) == 7
    assert moved("pagedq:request_success_total", tuple(sorted((*vllm_labels, ("finished_reason", "length"))))) == 1
    assert moved("pagedq:iteration_tokens_total_sum", vllm_labels) >= 7
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total"):
        assert (f"pagedq:{gauge}", vllm_labels) in after
    assert {labels for name, labels in after if name == "pagedq:queue_depth"} == {
        (("queue", QUEUE),), (("queue", f"{QUEUE}.batch"),)}
    assert after[("pagedq:jobs_requeued_total", ())] == 0

    route = (("method", "POST"), ("route", "/v1/completions"), ("status", "200"))
    assert api_after[("pagedq:api_requests_total", route)] - api_before.get(("pagedq:api_requests_total", route), 0) == 1
    submitted = ("pagedq:jobs_submitted_total", (("queue", QUEUE),))
    assert api_after[submitted] - api_before.get(submitted, 0) == 1
    assert ("pagedq:queue_depth", (("queue", f"{QUEUE}.batch"),)) in api_after
    # The api's page carries the workers' series too (one worker here: its own numbers).
    for series in (("pagedq:generation_tokens_total", vllm_labels), ("pagedq:jobs_finished_total", ()),
                   ("pagedq:e2e_request_latency_seconds_count", vllm_labels)):
        assert api_after[series] == after[series]


def sse_payloads(response: httpx.Response) -> list:
    """The JSON payloads of an SSE response, up to `[DONE]` (which must end it)."""
    import json

    data = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def test_prompt_lists_give_choices_prompt_by_prompt_as_openai_does(service, client, model):
    """OpenAI and vLLM accept a list of prompts (strings or token-id lists) in one
    /v1/completions request: choice i * n + j is prompt i's j-th output; usage sums."""
    api, _ = service
    prompts = ["The quick brown fox", "A list of prompts", "Third one"]
    sampling = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    expected = offline_greedy(model, [{"prompt": p, **sampling} for p in prompts])
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [tokenizer.decode(ids) for ids in expected]

    completion = client.completions.create(model=model.name, prompt=prompts, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1, 2] and [c.text for c in completion.choices] == texts
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt_tokens, 15)

    by_ids = client.completions.create(model=model.name, prompt=[tokenizer.encode(p) for p in prompts[:2]], n=2,
                                       max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert [(c.index, c.text) for c in by_ids.choices] == [(0, texts[0]), (1, texts[0]), (2, texts[1]), (3, texts[1])]

    body = {"model": model.name, "prompt": prompts, "stream": True, **sampling}
    chunks = sse_payloads(httpx.post(f"{api.url}/v1/completions", json=body, timeout=60))
    for index, text in enumerate(texts):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(choice["text"] for choice in mine) == text and mine[-1]["finish_reason"] == "length"


def test_streams_carry_usage_null_or_continuous_usage_as_vllm_does(service, model):
    """vLLM: every chunk has a `usage` key, null unless stream_options asks for
    continuous_usage_stats (with include_usage); then each chunk carries its choice's
    prompt tokens and tokens so far, and a last chunk with no choices the total."""
    api, _ = service
    body = {"model": model.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "stream": True}
    plain = sse_payloads(httpx.post(f"{api.url}/v1/chat/completions", json=body, timeout=60))
    assert all("usage" in c and c["usage"] is None for c in plain)

    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = sse_payloads(httpx.post(f"{api.url}/v1/chat/completions", json={**body, "stream_options": options}, timeout=60))
    *choice_chunks, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    prompt_tokens = final["usage"]["prompt_tokens"]
    counts = [c["usage"]["completion_tokens"] for c in choice_chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 6
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens and c["usage"]["total_tokens"] == prompt_tokens
               + c["usage"]["completion_tokens"] for c in choice_chunks)


def test_openai_client_streams_chat_with_continuous_usage(client, model):
    stream = client.chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks) and chunks[-1].usage.completion_tokens == 4


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_logprobs_equal_the_non_streamed_ones(client, model, endpoint):
    common = dict(model=model.name, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    if endpoint == "completions":
        whole = client.completions.create(prompt="Stream my logprobs", logprobs=2, **common).choices[0].logprobs
        chunks = list(client.completions.create(prompt="Stream my logprobs", logprobs=2, stream=True, **common))
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert [t for p in parts for t in p.tokens] == whole.tokens
        assert [lp for p in parts for lp in p.token_logprobs] == pytest.approx(whole.token_logprobs, abs=1e-4)
        assert [o for p in parts for o in p.text_offset] == whole.text_offset
        streamed_top = [top for p in parts for top in p.top_logprobs]
        assert [sorted(top) for top in streamed_top] == [sorted(top) for top in whole.top_logprobs]
        assert [v for top in streamed_top for v in top.values()] == pytest.approx(
            [v for top in whole.top_logprobs for v in top.values()], abs=1e-4)
    else:
        messages = [{"role": "user", "content": "Stream my logprobs"}]
        whole = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **common)
        chunks = list(client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, stream=True, **common))
        steps = [s for c in chunks if c.choices and c.choices[0].logprobs for s in c.choices[0].logprobs.content]
        assert [(s.token, round(s.logprob, 5), len(s.top_logprobs)) for s in steps] == [
            (s.token, round(s.logprob, 5), 2) for s in whole.choices[0].logprobs.content]


def _strict_json(text: str):
    """JSON as a strict parser reads it: no Infinity or NaN."""
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_logprobs_of_tokens_a_grammar_rules_out_are_finite_json(service, model):
    """A choice grammar leaves two tokens; the top 5 alternatives hold tokens it rules out,
    logprob -inf, which JSON cannot hold (a 500, and streamed chunks with -Infinity): as
    vLLM's server writes them, -9999.0, streamed or not."""
    api, _ = service
    body = {"model": model.name, "prompt": "hi", "structured_outputs": {"choice": ["yes", "no"]}, "logprobs": 5,
            "max_tokens": 5, "temperature": 0}
    answer = httpx.post(f"{api.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    tops = _strict_json(answer.text)["choices"][0]["logprobs"]["top_logprobs"]
    values = [value for top in tops for value in top.values()]
    assert -9999.0 in values and min(values) == -9999.0
    streamed = httpx.post(f"{api.url}/v1/completions", json={**body, "stream": True}, timeout=60).text
    chunks = [_strict_json(line.removeprefix("data: ")) for line in streamed.splitlines() if line.startswith("data: {")]
    assert [top for chunk in chunks for c in chunk["choices"] if c["logprobs"] for top in c["logprobs"]["top_logprobs"]] == tops


def test_harmless_openai_fields_are_ignored_and_vllm_fields_accepted(service, client, model):
    ignored = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "safety_identifier": "s",
               "prompt_cache_key": "p"}
    completion = client.completions.create(model=model.name, prompt="hi", max_tokens=2,
                                           extra_body={**ignored, "spaces_between_special_tokens": False})
    assert completion.usage.completion_tokens <= 2
    chat = client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={**ignored, "parallel_tool_calls": False, "reasoning_effort": "low"})
    assert chat.choices[0].message.role == "assistant"


def test_files_list_with_the_openai_client(client):
    uploaded = [client.files.create(file=(f"f{i}.jsonl", b"{}\n"), purpose="batch") for i in range(3)]
    listed = [f.id for f in client.files.list()]
    assert [f.id for f in reversed(uploaded)] == [i for i in listed if i in {f.id for f in uploaded}]
    page = client.files.list(limit=2, order="asc", purpose="batch")
    assert len(page.data) == 2 and page.has_more
    # The client's auto-paging walks every page (limit + after).
    assert [f.id for f in uploaded] == [f.id for f in client.files.list(limit=1, order="asc") if f.id in {u.id for u in uploaded}]
    assert all(f.purpose == "batch" for f in client.files.list(purpose="batch"))


def test_langchain_openai_batch_sends_a_prompt_list(service, model):
    """langchain-openai's OpenAI(...).batch([...]) sends its prompts in one request."""
    langchain_openai = pytest.importorskip("langchain_openai")
    api, _ = service
    llm = langchain_openai.OpenAI(model=model.name, base_url=f"{api.url}/v1", api_key="unused", max_tokens=4,
                                  temperature=0, max_retries=0, batch_size=20)
    prompts = ["one", "two", "three"]
    answers = llm.batch(prompts)
    expected = offline_greedy(model, [{"prompt": p, "max_tokens": 4, "temperature": 0} for p in prompts])
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert answers == [tokenizer.decode(ids) for ids in expected]


# ---- issue 28: vLLM's request fields, routes and stream timing ------------------------------

CHOICES = ["red", "green", "blue"]


def test_structured_outputs_and_response_format_shape_the_text(service, client, model):
    """vLLM maps response_format json_object / json_schema to structured_outputs' json_object
    / json, and takes structured_outputs (choice, regex, ...) in the body: the text follows."""
    import re

    chosen = client.completions.create(model=model.name, prompt="Pick one", max_tokens=8, temperature=1.0, seed=3,
                                       extra_body={"structured_outputs": {"choice": CHOICES}})
    assert chosen.choices[0].text in CHOICES
    regex = client.chat.completions.create(
        messages=[{"role": "user", "content": "A code"}], model=model.name, max_tokens=12, temperature=1.0, seed=3,
        extra_body={"structured_outputs": {"regex": "[a-c]{2}-[0-9]{3}"}})
    assert re.fullmatch("[a-c]{2}-[0-9]{3}", regex.choices[0].message.content)
    schema = {"type": "object", "properties": {"colour": {"enum": CHOICES}}, "required": ["colour"],
              "additionalProperties": False}
    shaped = client.chat.completions.create(
        messages=[{"role": "user", "content": "A colour"}], model=model.name, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": schema, "strict": True}})
    # Greedy, a random model may write the whitespace the grammar allows between tokens
    # until max_tokens: without it, the text is (the start of) an object the schema allows.
    compact = "".join(shaped.choices[0].message.content.split())
    assert any(f'{{"colour":"{c}"}}'.startswith(compact) for c in CHOICES) and len(compact) > 1, compact
    anything = client.completions.create(model=model.name, prompt="{", max_tokens=30, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert anything.choices[0].text.lstrip().startswith("{")


def test_token_rules_and_return_token_ids(service, client, model):
    """logit_bias (clamped to ±100, as vLLM), allowed_token_ids; return_token_ids puts the
    prompt's and each choice's token ids in the response, as vLLM's does."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    biased = client.completions.create(model=model.name, prompt="Say it", max_tokens=5, logit_bias={"9": 500},
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    (choice,) = biased.choices
    assert choice.token_ids == [9] * 5 and choice.prompt_token_ids == tokenizer.encode("Say it")
    allowed = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], model=model.name, max_tokens=6, temperature=1.0,
        extra_body={"allowed_token_ids": [7, 11], "ignore_eos": True, "return_token_ids": True})
    assert set(allowed.choices[0].token_ids) <= {7, 11} and len(allowed.choices[0].token_ids) == 6
    assert allowed.prompt_token_ids == list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)["input_ids"])


def test_constraints_that_leave_no_token_are_the_clients_error(service, client, model):
    """allowed_token_ids of eos alone, within min_tokens: no token can be generated. The job
    fails on its input (never retried) and the answer is a 400 invalid_request_error,
    streamed or not, where it was a 500 job_failed."""
    api, _ = service
    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    extra = {"allowed_token_ids": [eos], "min_tokens": 2}
    with pytest.raises(openai.BadRequestError, match="no token is allowed"):
        client.completions.create(model=model.name, prompt="hi", max_tokens=6, extra_body=extra)
    body = {"model": model.name, "prompt": "hi", "max_tokens": 6, "stream": True, **extra}
    events = httpx.post(f"{api.url}/v1/completions", json=body, timeout=60).text.split("\n\n")
    errors = [json.loads(event.removeprefix("data: ")) for event in events if '"error"' in event]
    assert [(error["error"]["type"], error["error"]["code"]) for error in errors] == [("invalid_request_error", "invalid_request")]
    assert "no token is allowed" in errors[0]["error"]["message"] and events[-2] == "data: [DONE]"


def test_echo_truncation_and_beam_search(service, client, model):
    """echo puts the prompt before the text (with logprobs, the prompt's own: the first
    token has none, as vLLM's); truncate_prompt_tokens keeps the prompt's last N tokens;
    use_beam_search answers the same beams as POST /generate's beam search."""
    api, _ = service
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = "The quick brown fox jumps"
    prompt_ids = tokenizer.encode(prompt)
    echoed = client.completions.create(model=model.name, prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                                       echo=True, extra_body={"ignore_eos": True})
    (choice,) = echoed.choices
    assert choice.text.startswith(prompt) and len(choice.logprobs.tokens) == len(prompt_ids) + 3
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    assert choice.logprobs.text_offset[len(prompt_ids)] == len(tokenizer.decode(prompt_ids))
    streamed = list(client.completions.create(model=model.name, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == choice.text

    (expected,) = offline_greedy(model, [{"prompt_token_ids": prompt_ids[-3:], "max_tokens": 4, "temperature": 0,
                                          "ignore_eos": True}])
    truncated = client.completions.create(model=model.name, prompt=prompt, max_tokens=4, temperature=0, extra_body={
        "truncate_prompt_tokens": 3, "ignore_eos": True, "return_token_ids": True})
    assert truncated.usage.prompt_tokens == 3 and truncated.choices[0].prompt_token_ids == prompt_ids[-3:]
    assert truncated.choices[0].token_ids == expected

    beams = client.completions.create(model=model.name, prompt=prompt, max_tokens=4, n=2, temperature=0,
                                      extra_body={"use_beam_search": True, "ignore_eos": True})
    native = httpx.post(f"{api.url}/generate", json={"prompt": prompt, "max_tokens": 4, "use_beam_search": True,
                                                     "beam_width": 2, "ignore_eos": True}, timeout=30).json()
    result = httpx.get(f"{api.url}/result/{native['seq_id']}", params={"wait": 30}, timeout=40).json()
    assert [c.text for c in beams.choices] == [beam["text"] for beam in result["beams"]]
    # As vLLM's, beam search ignores the sampling fields it does not read; a temperature it
    # would sample with, pagedq's beam search cannot honour.
    ignored = client.completions.create(model=model.name, prompt=prompt, max_tokens=4, n=2, top_p=0.5, seed=1,
                                        extra_body={"use_beam_search": True, "ignore_eos": True, "top_k": 3})
    assert [c.text for c in ignored.choices] == [c.text for c in beams.choices]
    refused = httpx.post(f"{api.url}/v1/completions", json={"prompt": "x", "use_beam_search": True, "temperature": 0.5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"


def test_tokenize_detokenize_and_version_answer_as_vllm(service, model):
    """vLLM's POST /tokenize (prompt or chat messages, chat_template_kwargs reaching the
    template), POST /detokenize, GET /version; errors in OpenAI's shape, naming the field."""
    api, _ = service
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokens = httpx.post(f"{api.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    ids = tokenizer.encode("Hello world")
    max_model_len = httpx.get(f"{api.url}/v1/models").json()["data"][0]["max_model_len"]
    assert tokens == {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                      "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{api.url}/tokenize", json={"messages": messages, "chat_template_kwargs": {"bos_token": "<<"}}).json()
    assert chat["tokens"] == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                bos_token="<<")["input_ids"])
    assert chat["tokens"] != httpx.post(f"{api.url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert httpx.post(f"{api.url}/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    bad = httpx.post(f"{api.url}/detokenize", json={"model": model.name, "tokens": [1, 99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    for body, param in (({"prompt": 5}, "prompt"), ({"messages": messages, "prompt": "x"}, "prompt"),
                        ({"messages": messages, "add_special_tokens": True}, "add_special_tokens")):
        refused = httpx.post(f"{api.url}/tokenize", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    # vLLM ignores apply_chat_template's own arguments given as template variables.
    reserved = httpx.post(f"{api.url}/tokenize", json={"messages": messages, "chat_template_kwargs": {
        "tokenize": False, "add_generation_prompt": False}})
    assert reserved.json()["tokens"] == httpx.post(f"{api.url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert httpx.get(f"{api.url}/version").json()["version"]


def test_responses_api_streamed_or_not_with_the_openai_client(service, client, model):
    """POST /v1/responses: instructions and input become the chat conversation; the same
    text as the chat completion, and streamed as the Responses API's events."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=model.name, messages=messages, max_tokens=6, temperature=0)
    response = client.responses.create(model=model.name, instructions="Be brief.", input="Name a colour.",
                                       max_output_tokens=6, temperature=0)
    assert response.output_text == chat.choices[0].message.content and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    listed = client.responses.create(model=model.name, input=[{"role": "user", "content": "Name a colour."}],
                                     max_output_tokens=6, temperature=0)
    assert listed.output_text  # the same conversation without the system message

    events = list(client.responses.create(model=model.name, instructions="Be brief.", input="Name a colour.",
                                          max_output_tokens=6, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    # vLLM ends the stream with response.completed, its status "incomplete" when max_output_tokens cut it.
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert events[-1].response.status == "incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].response.output_text == response.output_text and events[-1].response.usage.output_tokens == 6
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # text.format is response_format's json_schema, flat: the same constrained text as chat's;
    # the response repeats it as sent.
    schema = {"type": "object", "properties": {"colour": {"enum": CHOICES}}, "required": ["colour"]}
    shaped = client.responses.create(model=model.name, input="A colour as JSON", max_output_tokens=20, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    as_chat = client.chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "A colour as JSON"}], max_tokens=20, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert shaped.output_text == as_chat.choices[0].message.content and shaped.output_text.lstrip().startswith("{")
    assert shaped.text.format.schema_ == schema
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=model.name, input="hi", previous_response_id="resp_1")


def test_chat_stream_sends_its_role_with_the_first_output_and_usage_only_when_asked(model, service, tmp_path):
    """vLLM sends chat's role chunk with the first output: on a queue no worker serves,
    the stream has nothing to say yet (a role sent at once would make a benchmark's TTFT
    the queueing time). include_usage is false unless sent, as vLLM's."""
    api, _ = service
    settings = service_settings(model, api.settings.redis_url, tmp_path, queue_name="no-worker-stream")
    lonely = ApiServer(settings).start()
    body = {"model": model.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    try:
        with httpx.Client(timeout=httpx.Timeout(30, read=1.5)) as http, \
                http.stream("POST", f"{lonely.url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.ReadTimeout):
                next(response.iter_raw())
    finally:
        lonely.stop()
    for options in ({}, {"continuous_usage_stats": True}):
        chunks = sse_payloads(httpx.post(f"{api.url}/v1/chat/completions", json={**body, "stream_options": options},
                                         timeout=60))
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["choices"] and c["usage"] is None for c in chunks)


def test_answers_follow_the_documented_response_models(service, model):
    """api.docs describes the answers the routes build themselves: real answers validate
    against those models (extra fields forbidden), so the documentation cannot drift."""
    from api.docs import ChatCompletionResponse, CompletionResponse, ModelList

    api, _ = service
    common = {"model": model.name, "max_tokens": 3, "logprobs": 1, "return_token_ids": True, "prompt_logprobs": 2}
    completion = CompletionResponse.model_validate(httpx.post(
        f"{api.url}/v1/completions", json={**common, "prompt": "Hi there you"}, timeout=30).json())
    chat = {**common, "logprobs": True, "top_logprobs": 1, "messages": [{"role": "user", "content": "Hi"}]}
    answer = ChatCompletionResponse.model_validate(httpx.post(f"{api.url}/v1/chat/completions", json=chat,
                                                              timeout=30).json())
    # vLLM's prompt_logprobs: None for the first prompt token, then the prompt's own token
    # and the top 2 (ranks 1, 2; the own token's rank unknown when it is not among them).
    for steps, prompt_ids in ((completion.choices[0].prompt_logprobs, completion.choices[0].prompt_token_ids),
                              (answer.prompt_logprobs, answer.prompt_token_ids)):
        assert steps[0] is None and len(steps) == len(prompt_ids)
        for step, token_id in zip(steps[1:], prompt_ids[1:]):
            assert next(iter(step)) == str(token_id)  # vLLM lists the prompt's own token first
            assert sorted(e.rank for e in step.values() if e.rank is not None) == [1, 2]
            assert len(step) == 2 or step[str(token_id)].rank is None
    refused = httpx.post(f"{api.url}/v1/completions", json={**common, "prompt": "x", "return_token_ids": False,
                                                           "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    ModelList.model_validate(httpx.get(f"{api.url}/v1/models").json())
