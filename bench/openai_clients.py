"""Issue 28's table, as a user of vLLM's OpenAI server would try it: each client flow
against a running server, one line each (ok / FAIL and what came back).

    python bench/openai_clients.py --base-url http://127.0.0.1:8000 --model NAME [--api-key KEY]

Run it against `pagedq up` and `vllm serve` on the same checkpoint to compare. LangChain and
the openai SDK are the test extras; litellm rows run where litellm is installed.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import httpx
from pydantic import BaseModel, Field


class City(BaseModel):
    # Bounded, as a schema for a small model should be: an unbounded integer lets SmolLM2
    # write digits until max_tokens (vllm serve 0.32: 17/20 valid with `ge=0` alone).
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "Tell me about Paris as JSON."}]


def rows(base: str, model: str, key: str):
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
    http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    chat = dict(model=model, max_tokens=300, temperature=0)

    def parse():
        out = client.chat.completions.parse(messages=ASK, response_format=City, **chat)
        return out.choices[0].message.parsed is not None, out.choices[0].message.content

    def json_object():
        out = client.chat.completions.create(messages=ASK, response_format={"type": "json_object"}, **chat)
        return isinstance(json.loads(out.choices[0].message.content), dict), out.choices[0].message.content

    def json_schema():
        schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema()}}
        out = client.chat.completions.create(messages=ASK, response_format=schema, **chat)
        City.model_validate_json(out.choices[0].message.content)
        return True, out.choices[0].message.content

    def structured(kind, value, check):
        def run():
            out = client.completions.create(model=model, prompt="Answer:", max_tokens=60, temperature=0,
                                            extra_body={"structured_outputs": {kind: value}})
            text = out.choices[0].text
            return check(text), text
        return run

    def langchain(method):
        def run():
            from langchain_openai import ChatOpenAI

            llm = ChatOpenAI(base_url=f"{base}/v1", api_key=key, model=model, temperature=0, max_tokens=300, max_retries=0)
            out = llm.with_structured_output(City, method=method).invoke("Tell me about Paris.")
            return isinstance(out, (City, dict)), repr(out)
        return run

    def bind_tools():
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(base_url=f"{base}/v1", api_key=key, model=model, temperature=0, max_tokens=80, max_retries=0)
        out = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather").invoke("Weather in Oslo?")
        return bool(out.tool_calls), repr(out.tool_calls)

    def litellm_parse():
        import litellm

        out = litellm.completion(model=f"openai/{model}", api_base=f"{base}/v1", api_key=key, messages=ASK,
                                 response_format=City, max_tokens=300, temperature=0)
        City.model_validate_json(out.choices[0].message.content)
        return True, out.choices[0].message.content

    def tool_turns(choice):
        def run():
            messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
            first = client.chat.completions.create(messages=messages, tools=[WEATHER_TOOL], tool_choice=choice, **chat)
            call = first.choices[0].message.tool_calls[0]
            json.loads(call.function.arguments)
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "12 degrees, rain"},
            ]
            second = client.chat.completions.create(messages=messages, tools=[WEATHER_TOOL], **chat)
            return True, (f"finish_reason {first.choices[0].finish_reason}: {call.function.name}({call.function.arguments})"
                          f" -> {second.choices[0].message.content!r}")
        return run

    def route(method, path, body=None):
        def run():
            response = http.request(method, path, json=body)
            return response.status_code == 200, response.text[:160]
        return run

    def completion_field(**extra):
        def run():
            response = http.post("/v1/completions", json={"model": model, "prompt": "Hello world", "max_tokens": 5, **extra})
            return response.status_code == 200, response.text[:160]
        return run

    def no_model():
        response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
        return response.status_code == 200, response.text[:120]

    def role_with_first_token():
        """The first chunk (the role) must come with the first output, not when the job is queued."""
        long_prompt = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 60
        start = time.perf_counter()
        stream = client.chat.completions.create(messages=[{"role": "user", "content": long_prompt}], stream=True, **chat)
        times = []
        for chunk in stream:
            times.append(time.perf_counter() - start)
            if len(times) == 2:
                break
        stream.close()
        return times[1] - times[0] < 0.5 * times[1], f"first chunk {times[0] * 1000:.0f} ms, second {times[1] * 1000:.0f} ms"

    def usage_default():
        response = http.post("/v1/chat/completions", json={"model": model, "messages": ASK, "max_tokens": 5, "stream": True,
                                                           "stream_options": {}})
        usage = [line for line in response.text.splitlines() if '"usage":{' in line.replace(" ", "")]
        return not usage, f"{len(usage)} usage chunks"

    yield "openai chat.completions.parse(response_format=Pydantic)", parse
    yield "response_format json_object", json_object
    yield "response_format json_schema", json_schema
    yield "structured_outputs json", structured("json", City.model_json_schema(),
                                                lambda t: City.model_validate_json(t) is not None)
    yield "structured_outputs regex", structured("regex", r"[0-9]{3}-[a-z]{3}", lambda t: len(t) == 7)
    yield "structured_outputs choice", structured("choice", ["yes", "no"], lambda t: t in ("yes", "no"))
    yield "structured_outputs grammar", structured("grammar", 'root ::= "a" | "b"', lambda t: t in ("a", "b"))
    for method in ("json_schema", "function_calling", "json_mode"):
        yield f"LangChain with_structured_output({method})", langchain(method)
    yield "LangChain bind_tools", bind_tools
    yield "litellm response_format=Pydantic", litellm_parse
    yield "tools, tool_choice named, then a tool turn", tool_turns({"type": "function", "function": {"name": "get_weather"}})
    yield "tools, tool_choice required, then a tool turn", tool_turns("required")
    yield "POST /tokenize", route("POST", "/tokenize", {"model": model, "prompt": "Hello world"})
    yield "POST /detokenize", route("POST", "/detokenize", {"model": model, "tokens": [1, 2, 3]})
    yield "GET /version", route("GET", "/version")
    yield "POST /v1/responses", route("POST", "/v1/responses", {"model": model, "input": "Say hi", "max_output_tokens": 8})
    yield "logit_bias", completion_field(logit_bias={"50": 100})
    yield "echo + logprobs", completion_field(echo=True, logprobs=1)
    yield "prompt_logprobs", completion_field(prompt_logprobs=1)
    yield "allowed_token_ids", completion_field(allowed_token_ids=[50, 51, 52])
    yield "bad_words", completion_field(bad_words=["the"])
    yield "truncate_prompt_tokens", completion_field(truncate_prompt_tokens=2)
    yield "use_beam_search", completion_field(use_beam_search=True, n=2)
    yield "return_token_ids", completion_field(return_token_ids=True)
    yield "chat_template_kwargs", route("POST", "/v1/chat/completions", {
        "model": model, "messages": ASK, "max_tokens": 4, "chat_template_kwargs": {"enable_thinking": False}})
    yield "model omitted", no_model
    yield "streamed chat: role chunk with the first token", role_with_first_token
    yield "stream_options {}: no usage chunk", usage_default


def schema_trials(base: str, model: str, key: str, count: int) -> None:
    """`count` sampled chat requests under response_format json_schema (a seed each): how many validate."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=300)
    cities = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Sydney", "Quebec", "Nairobi", "Berlin", "Hanoi"]
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema()}}
    valid = 0
    for i in range(count):
        out = client.chat.completions.create(
            model=model, max_tokens=400, temperature=0.7, seed=i, response_format=schema,
            messages=[{"role": "user", "content": f"Give me facts about {cities[i % len(cities)]} as JSON."}])
        try:
            City.model_validate_json(out.choices[0].message.content)
            valid += 1
        except ValueError:
            print(f"  not valid ({out.choices[0].finish_reason}): {out.choices[0].message.content[:120]!r}")
    print(f"json_schema trials: {valid}/{count} validate")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--schema-trials", type=int, metavar="N",
                        help="instead of the table: N sampled json_schema chat requests, how many validate")
    args = parser.parse_args()
    if args.schema_trials:
        schema_trials(args.base_url, args.model, args.api_key, args.schema_trials)
        return
    passed = 0
    all_rows = list(rows(args.base_url, args.model, args.api_key))
    for name, run in all_rows:
        try:
            ok, detail = run()
        except ImportError as exc:
            ok, detail = None, f"skipped: {exc}"
        except Exception as exc:  # a row's failure is its own
            ok, detail = False, f"{type(exc).__name__}: {str(exc)[:200]}"
            if isinstance(exc, (KeyError, TypeError, AttributeError)):
                detail += " " + traceback.format_exc(limit=1).splitlines()[-1]
        passed += bool(ok)
        mark = "skip" if ok is None else ("ok" if ok else "FAIL")
        print(f"{mark:4}  {name:55}  {' '.join(str(detail).split())[:150]}", flush=True)
    print(f"\n{passed} of {len(all_rows)} rows ok")


if __name__ == "__main__":
    main()
