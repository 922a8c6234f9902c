"""The API's documentation as its users read it (/docs, /redoc, /openapi.json): an
introduction, a description of each route group, and for every route a typed response
(the model its answer follows) with an example, so Redoc's response samples show real
answers rather than `{}`.

Routes that answer with a response they build themselves (OpenAI's bodies, streams,
Prometheus text) declare no response model to FastAPI; their documented shape is added
here, in one table, when the schema is generated. The models below describe those
answers; tests/test_openai_api.py validates real answers against them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from api.batches.schemas import BatchObject
from api.files import FileObject

DESCRIPTION = """
pagedq serves a language model over HTTP: a continuous-batching engine on a paged KV cache,
behind a queue, so any number of requests can be submitted and any number of GPU workers
can serve them.

**Two ways in**

* **OpenAI-compatible** (`/v1/...`): point any OpenAI client at `http://HOST:PORT/v1`.
  Completions, chat completions and the Responses API, streamed or not; vLLM's extra
  request fields (`top_k`, `min_p`, `structured_outputs`, `use_beam_search`, ...) as
  `extra_body`; the Batch API (`/v1/files`, `/v1/batches`) for large offline jobs.
* **Native** (`/generate`, `/result/{seq_id}`, `/stream/{seq_id}`): submit a prompt and get
  a job id at once (`202`), then poll for the result or follow its tokens as server-sent
  events. Jobs survive a worker's crash: another worker picks them up.

**Authentication**: when the server has API keys, send `Authorization: Bearer <key>`
(the *Authorize* button here does it for you). `/health` and `/version` are open.

**Errors** are JSON: on `/v1`, `/tokenize` and `/detokenize` OpenAI's
`{"error": {"message", "type", "param", "code"}}`, where `param` names the field that was
wrong; elsewhere `{"error": <kind>, "message": <what went wrong>}`.

```
curl http://localhost:8000/v1/completions -H 'Content-Type: application/json' \\
  -d '{"prompt": "The capital of France is", "max_tokens": 8}'
```
"""

TAGS = [
    {"name": "OpenAI-compatible", "description": "OpenAI's API (and vLLM's extensions of it): any OpenAI client works."},
    {"name": "Batch API", "description": "Upload a JSONL file of requests, create a batch, download the results."},
    {"name": "Native", "description": "Submit a job, then poll its result or stream its tokens; cancel it."},
    {"name": "Tokenizer", "description": "vLLM's utility routes: count and inspect tokens, and the server's version."},
    {"name": "Operations", "description": "Health, readiness and Prometheus metrics for load balancers and monitoring."},
]

_MODEL = "SmolLM2-135M-Instruct"
_OPERATIONS = ("/health", "/ready", "/metrics")


class ModelCard(BaseModel):
    id: str = Field(description="The name to send as `model`.")
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int = Field(description="The context length: prompt and output tokens together.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class _Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = Field(description="vLLM's: the stop string or token id that ended the text.")
    token_ids: list[int] | None = Field(None, description="With return_token_ids.")


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = Field(description="1: the likeliest; None: the prompt's token, not among the top ones.")
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids.")
    prompt_logprobs: PromptLogprobs | None = Field(None, description="With prompt_logprobs: per prompt token.")


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    created: int
    model: str
    usage: Usage


class CompletionResponse(_Answer):
    """POST /v1/completions (with stream=true: `text_completion` chunks, server-sent, then `data: [DONE]`)."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Answer):
    """POST /v1/chat/completions (with stream=true: `chat.completion.chunk`s, server-sent, then `data: [DONE]`)."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids.")
    prompt_logprobs: PromptLogprobs | None = Field(None, description="With prompt_logprobs: per prompt token.")


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready"]
    queue_depth: int | None = Field(None, description="Jobs waiting (admin keys only).")
    workers: list[dict[str, Any]] | None = Field(None, description="Live workers and their engines' stats (admin keys only).")


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class RefusedLines(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]] = Field(description="Error-file lines: custom_id and the error of each refused line.")


_USAGE = {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}
_FILE = {"id": "file-6f1c0f0d2c1e4b7a", "object": "file", "bytes": 1204, "created_at": 1764190000,
         "filename": "requests.jsonl", "purpose": "batch", "status": "processed", "expires_at": 1764794800,
         "status_details": None}
_BATCH = {"id": "batch_0c1d2e3f", "object": "batch", "endpoint": "/v1/chat/completions", "model": _MODEL,
          "errors": None, "input_file_id": _FILE["id"], "completion_window": "24h", "status": "in_progress",
          "output_file_id": None, "error_file_id": None, "created_at": 1764190000, "in_progress_at": 1764190001,
          "expires_at": 1764276400, "finalizing_at": None, "completed_at": None, "failed_at": None,
          "expired_at": None, "cancelling_at": None, "cancelled_at": None,
          "request_counts": {"total": 100, "completed": 40, "failed": 0}, "usage": None, "metadata": None}
_RESULT = {"seq_id": "f3c9a2d1", "status": "finished", "text": " Paris, the city of light.",
           "token_ids": [7042, 28, 260, 2569, 282, 1000, 30], "finish_reason": "stop", "completions": None,
           "beams": None, "usage": {"prompt_tokens": 6, "completion_tokens": 7},
           "timings": {"enqueued": 1764190000.0, "started": 1764190000.01, "first_token": 1764190000.03,
                       "finished": 1764190000.12}, "error": None}
_RESPONSE = {
    "id": "resp_f3c9a2d1", "object": "response", "created_at": 1764190000, "status": "completed",
    "incomplete_details": None, "error": None, "instructions": "Answer in one word.", "max_output_tokens": 16,
    "model": _MODEL, "output": [{"type": "message", "id": "msg_f3c9a2d1", "status": "completed", "role": "assistant",
                                 "content": [{"type": "output_text", "text": "Paris", "annotations": [], "logprobs": []}]}],
    "parallel_tool_calls": False, "temperature": None, "top_p": None, "tool_choice": "none", "tools": [],
    "text": {"format": {"type": "text"}}, "store": False, "metadata": None,
    "usage": {"input_tokens": 21, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2,
              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 23}}
_SSE_CHAT = (
    'data: {"id": "chatcmpl-a1b2", "object": "chat.completion.chunk", "created": 1764190000, "model": "%s", '
    '"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, '
    '"finish_reason": null, "stop_reason": null}], "usage": null}\n\n'
    'data: {"id": "chatcmpl-a1b2", "object": "chat.completion.chunk", "created": 1764190000, "model": "%s", '
    '"choices": [{"index": 0, "delta": {"content": "Paris"}, "logprobs": null, "finish_reason": null, '
    '"stop_reason": null}], "usage": null}\n\n'
    "data: [DONE]\n\n" % (_MODEL, _MODEL)
)

# (method, path) -> summary, description, response model (None: the route's own, or none for
# text), an example answer, its media type.
ROUTES: dict[tuple[str, str], tuple[str, str, type[BaseModel] | None, Any, str]] = {
    ("get", "/v1/models"): ("List models", "The model this server serves.", ModelList, {"object": "list", "data": [
        {"id": _MODEL, "object": "model", "created": 1764190000, "owned_by": "pagedq", "max_model_len": 2048}]},
        "application/json"),
    ("get", "/v1/models/{model}"): ("Get a model", "The model's card; 404 for any other name.", ModelCard, {
        "id": _MODEL, "object": "model", "created": 1764190000, "owned_by": "pagedq", "max_model_len": 2048},
        "application/json"),
    ("post", "/v1/completions"): (
        "Create a completion",
        "Continue a prompt (a string, token ids, or a list of either: one choice per prompt and sample). "
        "With `stream: true`, server-sent `text_completion` chunks end with `data: [DONE]`. "
        "vLLM's fields: `structured_outputs`, `response_format`, `use_beam_search`, `echo`, "
        "`truncate_prompt_tokens`, `return_token_ids`, `logit_bias`, `allowed_token_ids`, `bad_words`, ...",
        CompletionResponse, {"id": "cmpl-a1b2", "object": "text_completion", "created": 1764190000, "model": _MODEL,
                             "choices": [{"index": 0, "text": " Paris, the city of light.", "logprobs": None,
                                          "finish_reason": "length", "stop_reason": None}], "usage": _USAGE},
        "application/json"),
    ("post", "/v1/chat/completions"): (
        "Create a chat completion",
        "Answer a conversation, rendered through the model's chat template. With `stream: true`, "
        "server-sent `chat.completion.chunk`s (the first carries the role) end with `data: [DONE]`; "
        "`stream_options.include_usage` adds a last chunk with the usage.",
        ChatCompletionResponse, {"id": "chatcmpl-a1b2", "object": "chat.completion", "created": 1764190000,
                                 "model": _MODEL, "choices": [{"index": 0, "message": {
                                     "role": "assistant", "content": "Paris."}, "logprobs": None,
                                     "finish_reason": "stop", "stop_reason": None}], "usage": _USAGE},
        "application/json"),
    ("post", "/v1/files"): ("Upload a file", "A JSONL file of requests for the Batch API (purpose `batch`).",
                            FileObject, _FILE, "application/json"),
    ("get", "/v1/files"): ("List files", "Your files, newest first unless `order=asc`; page with `after`.",
                           FileList, {"object": "list", "data": [_FILE], "has_more": False, "first_id": _FILE["id"],
                                      "last_id": _FILE["id"]}, "application/json"),
    ("get", "/v1/files/{file_id}"): ("Get a file", "The file's object.", FileObject, _FILE, "application/json"),
    ("delete", "/v1/files/{file_id}"): ("Delete a file", "Deletes the file.", FileDeleted,
                                        {"id": _FILE["id"], "object": "file", "deleted": True}, "application/json"),
    ("get", "/v1/files/{file_id}/content"): (
        "Download a file", "The file's bytes: a batch's output or error file is JSONL, one line per request.",
        None, '{"id": "batch_req_1", "custom_id": "q1", "response": {"status_code": 200, "body": {...}}, '
        '"error": null}\n', "application/jsonl"),
    ("post", "/v1/batches"): ("Create a batch", "Runs every line of an uploaded file; poll it until it ends.",
                              BatchObject, _BATCH, "application/json"),
    ("get", "/v1/batches"): ("List batches", "Your batches, newest first; page with `after`.", BatchList,
                             {"object": "list", "data": [_BATCH], "first_id": _BATCH["id"], "last_id": _BATCH["id"],
                              "has_more": False}, "application/json"),
    ("get", "/v1/batches/{batch_id}"): ("Get a batch", "Its status, counts and, once ended, its output and error files.",
                                        BatchObject, _BATCH, "application/json"),
    ("get", "/v1/batches/{batch_id}/refused"): (
        "Lines refused so far", "pagedq's extension: the input lines refused so far, as error-file lines.",
        RefusedLines, {"object": "list", "data": [{"custom_id": "q7", "error": {
            "code": "invalid_request", "message": "line 7: max_tokens: Input should be greater than or equal to 1"}}]},
        "application/json"),
    ("post", "/v1/batches/{batch_id}/cancel"): ("Cancel a batch", "Stops its remaining lines; finished ones are kept.",
                                                BatchObject, {**_BATCH, "status": "cancelling",
                                                              "cancelling_at": 1764190300}, "application/json"),
    ("post", "/generate"): ("Submit a job", "Queues a prompt (or `prompt_token_ids`, or chat `messages`) with "
                            "vLLM's sampling fields and answers `202` with its `seq_id` at once. Send an "
                            "`Idempotency-Key` header to make retries safe.", None,
                            {"seq_id": "f3c9a2d1", "status": "queued",
                             "result_url": "http://localhost:8000/result/f3c9a2d1"}, "application/json"),
    ("get", "/result/{seq_id}"): ("Get a job's result", "Its status and, once finished, its text, token ids and "
                                  "usage; `wait=SECONDS` waits for it to end.", None, _RESULT, "application/json"),
    ("delete", "/result/{seq_id}"): ("Cancel a job", "Cancels a queued or running job; 409 once it has ended.",
                                     None, {**_RESULT, "status": "canceled", "text": "", "token_ids": [],
                                            "finish_reason": None, "usage": None}, "application/json"),
    ("post", "/v1/responses"): (
        "Create a response", "OpenAI's Responses API, text in and text out: `input` (a string or messages) after "
        "`instructions`. With `stream: true`, its events (response.created, response.output_text.delta, ..., "
        "response.completed). Responses are not stored.", None, _RESPONSE, "application/json"),
    ("post", "/tokenize"): ("Tokenize", "The token ids the model reads for a `prompt`, or for chat `messages` "
                            "through its chat template (vLLM's request and answer).", None,
                            {"count": 4, "max_model_len": 2048, "tokens": [504, 3575, 282, 4649], "token_strs": None},
                            "application/json"),
    ("post", "/detokenize"): ("Detokenize", "Token ids back to text (vLLM's).", None, {"prompt": "The capital of"},
                              "application/json"),
    ("get", "/version"): ("Version", "The server's version (vLLM's route); open to anyone.", None,
                          {"version": "0.1.0"}, "application/json"),
    ("get", "/stream/{seq_id}"): (
        "Stream a job's tokens", "Server-sent events: `delta` events with the new text, then `end`. Reconnect "
        "with `Last-Event-ID` to resume where the connection dropped.", None,
        'id: 1764190000000-0\nevent: delta\ndata: {"index": 0, "text": " Paris", "num_tokens": 1}\n\n'
        'id: 1764190000120-0\nevent: end\ndata: {"status": "finished"}\n\n', "text/event-stream"),
    ("get", "/health"): ("Health", "Always `ok` while the api process answers (no dependency checked).", Health,
                         {"status": "ok"}, "application/json"),
    ("get", "/ready"): ("Readiness", "`ready` when Redis takes writes and at least one worker is live; else 503 "
                        "with the reason.", Ready, {"status": "ready"}, "application/json"),
    ("get", "/metrics"): (
        "Prometheus metrics", "The api's request counters, queue depths and every live worker's engine series "
        "(vLLM's names), summed across workers. Needs an admin key when keys are on.", None,
        '# HELP vllm:num_requests_running Requests in the engine\'s running queue.\n# TYPE vllm:num_requests_running '
        f'gauge\nvllm:num_requests_running{{engine="0",model_name="{_MODEL}"}} 3.0\n', "text/plain"),
}


def install_docs(app: FastAPI) -> None:
    """The OpenAPI schema with ROUTES' summaries, descriptions, response models and examples."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes,
                                 tags=TAGS)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, operations in schema["paths"].items():
                for operation in operations.values():
                    operation.setdefault("tags", ["Operations" if path in _OPERATIONS else "Native"])
            for (method, path), (summary, description, model, example, media_type) in ROUTES.items():
                operation = schema["paths"][path][method]
                operation.update(summary=summary, description=description)
                ok = next(code for code in operation["responses"] if code.startswith("2"))
                content = operation["responses"][ok].setdefault("content", {})
                if media_type != "application/json":
                    content.pop("application/json", None)
                entry = content.setdefault(media_type, {})
                entry["example"] = example
                if model is not None:
                    model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                    components.update(model_schema.pop("$defs", {}))
                    components[model.__name__] = model_schema
                    entry["schema"] = {"$ref": f"#/components/schemas/{model.__name__}"}
                if path in ("/v1/completions", "/v1/chat/completions"):
                    content["text/event-stream"] = {"example": _SSE_CHAT}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
