"""Tool calling on /v1/chat/completions, driven by the `openai` package and LangChain
against a real redis-server, the api under uvicorn and a `pagedq worker` on a tiny random
model. A random model calls no tool by itself, so the calls here are forced (tool_choice
"required" or a named function), which structured outputs make valid JSON of the tools'
schemas; how each family's own calls are read is tests/test_tool_parsers.py's."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer
from transformers import AutoTokenizer

from pagedq.redis_server import RedisServer
from tests.service_helpers import ApiServer, WorkerProcess, service_settings, wait_for_worker, wait_until

pytestmark = pytest.mark.slow
QUEUE = "tools"

# Bounded schemas: a random model's arguments then end within max_tokens.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}},
}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}},
}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]
# Greedy, a random model pads JSON with whitespace until max_tokens (any whitespace is valid
# JSON, and vLLM's structured outputs allow it); sampled, it closes the JSON (with this seed, every
# forced call here within about 100 tokens; seeded sampling repeats itself).
SAMPLED = {"temperature": 1.0, "seed": 20, "max_tokens": 300}


def valid_arguments(name: str, arguments: str) -> dict:
    """The call's arguments, checked against its tool's schema."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7, args
    else:
        assert name == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"}), args
    return args


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    """One worker; an api started with --enable-auto-tool-choice --tool-call-parser hermes and one without."""
    model = tiny_model_dir()
    tmp = tmp_path_factory.mktemp("tools")
    redis_server = RedisServer(tmp / "redis").start()
    settings = service_settings(model, redis_server.url, tmp, queue_name=QUEUE, batch_poll_interval_s=0.2)
    worker = WorkerProcess(settings, tmp / "worker.log")
    plain = ApiServer(settings).start()
    auto = ApiServer(settings.with_overrides(port=service_settings(model, redis_server.url, tmp).port,
                                             enable_auto_tool_choice=True, tool_call_parser="hermes")).start()
    try:
        wait_for_worker(plain.url)
        yield plain, auto, Redis.from_url(redis_server.url), model
    finally:
        auto.stop()
        plain.stop()
        worker.stop()
        redis_server.stop()


def client_of(api: ApiServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_two_turn_agent_loop_with_named_then_required_tool_choice(service):
    plain, _, redis, model = service
    client = client_of(plain)
    first = client.chat.completions.create(model=model.name, messages=ASK, tools=TOOLS, **SAMPLED,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (choice,) = first.choices
    (call,) = choice.message.tool_calls
    # vLLM's ids; a named tool choice keeps finish_reason "stop", as vLLM and OpenAI answer.
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name == "get_weather"
    assert choice.finish_reason == "stop" and choice.message.content is None
    valid_arguments("get_weather", call.function.arguments)

    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    assert history[1]["tool_calls"] and "content" not in history[1]  # content null, as the SDK sends it back
    second = client.chat.completions.create(model=model.name, messages=history, tools=TOOLS, tool_choice="required",
                                            **SAMPLED)
    (choice,) = second.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("chatcmpl-tool-")
        valid_arguments(call.function.name, call.function.arguments)
    # The tool's answer reached the model through the chat template, in its own turn.
    job = Job.fetch(second.id.split("-", 1)[1], connection=redis, serializer=JSONSerializer)
    prompt = AutoTokenizer.from_pretrained(model).decode(job.kwargs["prompt_token_ids"])
    assert "<|tool|>\n18 degrees and sunny" in prompt

    plain_turn = client.chat.completions.create(model=model.name, messages=history, tools=TOOLS, tool_choice="none",
                                                max_tokens=8, temperature=0)
    assert plain_turn.choices[0].message.tool_calls is None and plain_turn.choices[0].finish_reason != "tool_calls"


def _streamed_calls(stream) -> tuple[list[dict], str | None]:
    """A stream's tool calls put together as OpenAI's clients do, checking OpenAI's delta shape:
    a call's first delta has its index, id, type and name; the rest add argument fragments."""
    calls: list[dict] = []
    finish_reason = None
    for chunk in stream:
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or []:
                if delta.index == len(calls):
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls.append({"id": delta.id, "name": delta.function.name, "arguments": delta.function.arguments or ""})
                else:
                    assert delta.id is None and delta.function.name is None and delta.index == len(calls) - 1
                    calls[delta.index]["arguments"] += delta.function.arguments
    return calls, finish_reason


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"],
                         ids=["named", "required"])
def test_streamed_tool_calls_add_up_to_the_answer(service, tool_choice):
    plain, _, _, model = service
    client = client_of(plain)
    request = dict(model=model.name, messages=ASK, tools=TOOLS, tool_choice=tool_choice, **SAMPLED)
    answer = client.chat.completions.create(**request).choices[0]
    calls, finish_reason = _streamed_calls(client.chat.completions.create(**request, stream=True))
    assert finish_reason == answer.finish_reason == ("stop" if tool_choice != "required" else "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in answer.message.tool_calls]
    for call in calls:
        valid_arguments(call["name"], call["arguments"])


def test_auto_tool_choice_needs_the_server_flags_as_in_vllm(service):
    plain, auto, _, model = service
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        refused = client_of(plain).with_options(max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            refused.chat.completions.create(model=model.name, messages=ASK, max_tokens=4, **body)
        assert caught.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in caught.value.body["message"]
    # With them, a reply without calls is content, streamed or not, alike.
    request = dict(model=model.name, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    answer = client_of(auto).chat.completions.create(**request).choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client_of(auto).chat.completions.create(**request, stream=True) if chunk.choices)
    assert streamed == answer.message.content


def test_bad_tools_are_a_400_naming_the_field(service):
    plain, _, _, model = service
    bad_schema = {"type": "function", "function": {"name": "broken", "parameters": {"type": "nonsense"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tools": [WEATHER, bad_schema], "tool_choice": "required"}, "tools[1].function.parameters"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
        ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]},
         "messages.1.tool_calls.0.function.arguments"),
        ({"messages": [*ASK, {"role": "tool", "content": "18 degrees"}]}, "messages.1"),
    ]
    for fields, param in cases:
        response = httpx.post(f"{plain.url}/v1/chat/completions", timeout=30,
                              json={"model": model.name, "messages": ASK, "max_tokens": 4, **fields})
        assert response.status_code == 400, (fields, response.text)
        assert response.json()["error"]["param"] == param, response.text

    # A batch line's output is built from its job alone, which does not keep how to read calls: refused.
    client = client_of(plain)
    line = {"custom_id": "tools", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model.name, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}}
    uploaded = client.files.create(file=("lines.jsonl", json.dumps(line).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b, 30,
                       "the batch to end", interval_s=0.1)
    (error,) = [json.loads(text) for text in client.files.content(batch.error_file_id).content.splitlines()]
    assert error["response"]["status_code"] == 400 and error["response"]["body"]["error"]["param"] == "tools"


def test_langchain_bind_tools_and_structured_output(service):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    plain, auto, _, model = service

    class Forecast(BaseModel):
        """The forecast wanted."""

        city: str = Field(json_schema_extra={"enum": ["Paris", "Oslo"]})
        days: int = Field(ge=1, le=7)

    def chat(api: ApiServer) -> ChatOpenAI:
        return ChatOpenAI(model=model.name, base_url=f"{api.url}/v1", api_key="unused", max_retries=0,
                          temperature=SAMPLED["temperature"], seed=SAMPLED["seed"], max_tokens=SAMPLED["max_tokens"])

    # with_structured_output(method="function_calling") names the schema's function in tool_choice.
    forecast = chat(plain).with_structured_output(Forecast, method="function_calling").invoke("Weather in Oslo?")
    assert isinstance(forecast, Forecast)

    # bind_tools sends tool_choice "auto" unless told: the auto server answers (a random model: text).
    assert isinstance(chat(auto).bind_tools([WEATHER]).invoke("Weather in Paris?").content, str)

    forced = chat(plain).bind_tools([WEATHER, CLOCK], tool_choice="get_time")
    question = HumanMessage("What time is it?")
    reply = forced.invoke([question])
    (call,) = reply.tool_calls
    assert call["name"] == "get_time" and call["args"] in ({"zone": "UTC"}, {"zone": "CET"})
    # The next turn sends the call and its result back, as LangChain's agent loops do.
    answer = chat(plain).bind_tools([WEATHER, CLOCK], tool_choice="none").invoke(
        [question, reply, ToolMessage("12:00", tool_call_id=call["id"])])
    assert isinstance(answer.content, str) and not answer.tool_calls


def test_openai_parse_and_langchain_json_schema_get_objects_of_their_schema(service):
    """The structured-output flows of the issue's table that need no tool: openai's
    `chat.completions.parse(response_format=PydanticModel)` (a json_schema response_format)
    and LangChain's `with_structured_output(method="json_schema")` both return the model."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    plain, _, _, model = service

    class Forecast(BaseModel):
        city: str = Field(json_schema_extra={"enum": ["Paris", "Oslo"]})
        days: int = Field(ge=1, le=7)

    parsed = client_of(plain).chat.completions.parse(
        model=model.name, messages=ASK, response_format=Forecast, **SAMPLED).choices[0].message.parsed
    assert isinstance(parsed, Forecast)
    llm = ChatOpenAI(model=model.name, base_url=f"{plain.url}/v1", api_key="unused", max_retries=0,
                     temperature=SAMPLED["temperature"], seed=SAMPLED["seed"], max_tokens=SAMPLED["max_tokens"])
    assert isinstance(llm.with_structured_output(Forecast, method="json_schema").invoke("Weather in Oslo?"), Forecast)


def test_every_answer_of_one_job_names_its_calls_alike(service):
    """A retry with the request's Idempotency-Key answers from the same job: its calls keep
    their ids (a client whose first answer was lost may have run the tools already, and its
    tool turn quotes them), whole or streamed; another job's calls get other ids. Before,
    each answer drew new random ids."""
    plain, _, _, model = service
    client = client_of(plain)
    request = dict(model=model.name, messages=ASK, tools=TOOLS, tool_choice="required", **SAMPLED)
    key = {"Idempotency-Key": "tool-ids-1"}
    first = client.chat.completions.create(**request, extra_headers=key)
    again = client.chat.completions.create(**request, extra_headers=key)
    assert again.id == first.id
    ids = [call.id for call in first.choices[0].message.tool_calls]
    assert ids and [call.id for call in again.choices[0].message.tool_calls] == ids
    streamed, _ = _streamed_calls(client.chat.completions.create(**request, stream=True, extra_headers=key))
    assert [call["id"] for call in streamed] == ids
    other = client.chat.completions.create(**request)
    assert not {call.id for call in other.choices[0].message.tool_calls} & set(ids)
