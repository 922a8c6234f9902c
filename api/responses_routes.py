"""POST /v1/responses: OpenAI's Responses API, text in and text out, streamed or not.

A response is a chat completion seen another way: `instructions` become a system
message, `input` (a string, or a list of messages) the conversation, `text.format` the
response_format, `max_output_tokens` max_tokens; the chat route (openai_compat.serve)
queues and follows the job, and its answer is rewritten into a Response object or, when
streamed, into the Responses API's events (response.created, response.output_text.delta,
..., response.completed). Nothing is stored: `previous_response_id` and `store=true`
get a 400 naming the field, as do tools (not served).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator

from api.auth import Caller, authenticate
from api.errors import ApiError, bad_request
from api.openai_compat import CHAT, serve
from api.openai_schemas import ChatCompletionRequest, JsonSchemaFormat, ResponseFormat
from pagedq.request_rules import ValidInput

router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)], tags=["OpenAI-compatible"])
_IGNORED = "Accepted and ignored: it changes nothing about the generated text."


class InputText(ValidInput):
    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text"]
    text: StrictStr


class InputMessage(ValidInput):
    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[InputText]

    def chat_message(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": content}


class TextFormat(BaseModel):
    """The Responses API's text.format: response_format's fields, flat."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))


class ResponsesRequest(ValidInput):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = Field(None, description="The served model (GET /v1/models); left out, that one.")
    input: StrictStr | list[InputMessage] = Field(description="A user message, or the conversation so far.")
    instructions: StrictStr | None = Field(None, description="A system message put before the input.")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: TextOptions | None = None
    store: bool | None = Field(None, description="Only false: responses are not stored.")
    previous_response_id: str | None = Field(None, description="Not served: send the conversation as input.")
    metadata: dict[str, str] | None = Field(None, description=_IGNORED)
    user: str | None = Field(None, description=_IGNORED)
    service_tier: str | None = Field(None, description=_IGNORED)
    safety_identifier: str | None = Field(None, description=_IGNORED)
    prompt_cache_key: str | None = Field(None, description=_IGNORED)

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        if self.store:
            raise ValueError("store: responses are not stored (send store=false, or leave it out)")
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: responses are not stored; send the conversation as input")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input: must be non-empty")
        return self

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this response is (ValueError naming a chat field it fails on)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages.extend(message.chat_message() for message in self.input)
        fields = {"messages": messages, "max_tokens": self.max_output_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "stream": self.stream, "model": self.model}
        if self.stream:
            fields["stream_options"] = {"include_usage": True}  # response.completed carries the usage
        if self.text is not None and self.text.format.type != "text":
            text_format = self.text.format
            fields["response_format"] = ResponseFormat(
                type=text_format.type,
                json_schema=None if text_format.type != "json_schema" else JsonSchemaFormat(
                    name=text_format.name or "response", schema=text_format.schema_ or {}, strict=text_format.strict),
            )
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """OpenAI's Response object (the fields a text response has)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool = False
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Literal["none"] = "none"
    tools: list = Field(default_factory=list)
    text: TextOptions = Field(default_factory=TextOptions)
    store: bool = False
    metadata: dict[str, str] | None = None
    usage: ResponseUsage | None = None


def _response(body: ResponsesRequest, response_id: str, model: str, created: int, text: str,
              finish_reason: str | None, usage: dict | None, done: bool = True) -> ResponseObject:
    incomplete = finish_reason == "length"
    status = "in_progress" if not done else "incomplete" if incomplete else "completed"
    # vLLM's: the message itself is complete, the response is what max_output_tokens cut short.
    output = [OutputMessage(id=f"msg_{response_id}", status="completed", content=[OutputText(text=text)])] if done else []
    return ResponseObject(
        id=f"resp_{response_id}", created_at=created, status=status, model=model, output=output,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if done and incomplete else None,
        instructions=body.instructions, max_output_tokens=body.max_output_tokens, temperature=body.temperature,
        top_p=body.top_p, text=body.text or TextOptions(), metadata=body.metadata,
        usage=None if usage is None else ResponseUsage(
            input_tokens=usage["prompt_tokens"], output_tokens=usage["completion_tokens"],
            total_tokens=usage["total_tokens"]),
    )


# A Response is served as a chat completion: an error naming one of the chat's fields names
# the Response's field it came from (longest first).
_RESPONSE_FIELDS = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
                    ("max_tokens", "max_output_tokens"), ("messages", "input"))


def _in_responses_terms(error: ApiError) -> ApiError:
    message, param = str(error.detail), error.param
    for chat_field, field in _RESPONSE_FIELDS:
        if message.startswith(chat_field):
            message = field + message.removeprefix(chat_field)
        if param is not None and param.startswith(chat_field):
            param = field + param.removeprefix(chat_field)
    return ApiError(error.status_code, message, getattr(error, "headers", None), param=param, code=error.code)


@router.post("/responses", response_model=ResponseObject,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "The Response, or with stream=true its events (server-sent)."}})
async def create_response(body: ResponsesRequest, request: Request, caller: Annotated[Caller, Depends(authenticate)],
                          idempotency_key: Annotated[str | None, Header()] = None):
    """Text in (a string or a list of messages, with optional `instructions`), text out;
    with `stream: true` the answer is the Responses API's events, ending with
    `response.completed`."""
    try:
        chat = body.chat_request()
        answer = await serve(request, CHAT, chat, caller, idempotency_key, key_scope="/v1/responses")
    except ValueError as exc:
        raise _in_responses_terms(bad_request(exc)) from None
    except ApiError as error:
        raise _in_responses_terms(error) from None
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(_events(body, answer.body_iterator), media_type="text/event-stream",
                                 headers=dict(answer.headers))
    if answer.status_code != 200:
        return answer  # the chat route's OpenAI error, as it is
    completion = json.loads(answer.body)
    (choice,) = completion["choices"]
    return JSONResponse(_response(body, completion["id"].removeprefix("chatcmpl-"), completion["model"],
                                  completion["created"], choice["message"]["content"], choice["finish_reason"],
                                  completion["usage"]).model_dump(mode="json"))


def _chunks(piece: str) -> list[dict]:
    """The JSON payloads of a piece of the chat route's stream (whole `data:` events)."""
    return [json.loads(line[len("data: "):]) for line in piece.split("\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


async def _events(body: ResponsesRequest, chat_stream) -> AsyncIterator[str]:
    """The chat stream's chunks as the Responses API's events; closed with them, so a client
    that leaves cancels its job as a chat client's does."""
    try:
        async for text in _translated(body, chat_stream):
            yield text
    finally:
        await chat_stream.aclose()


async def _translated(body: ResponsesRequest, chat_stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """The chat stream's chunks as the Responses API's events, numbered by sequence_number."""
    sequence = 0

    def event(kind: str, **data) -> str:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence - 1, **data})}\n\n"

    response_id = model = None
    created = int(time.time())
    text, finish_reason, started = [], None, False
    async for piece in chat_stream:
        out = []
        for chunk in _chunks(piece):
            if "error" in chunk:
                error = chunk["error"]
                out.append(event("error", code=error.get("code"), message=error["message"], param=error.get("param")))
                yield "".join(out)
                return
            if response_id is None:
                response_id, model = chunk["id"].removeprefix("chatcmpl-"), chunk["model"]
                snapshot = _response(body, response_id, model, created, "", None, None, done=False)
                out.append(event("response.created", response=snapshot.model_dump(mode="json")))
                out.append(event("response.in_progress", response=snapshot.model_dump(mode="json")))
            item = {"item_id": f"msg_{response_id}", "output_index": 0}
            for choice in chunk["choices"]:
                delta = choice["delta"].get("content")
                if not started:
                    started = True
                    out.append(event("response.output_item.added", output_index=0, item={
                        "type": "message", "id": item["item_id"], "status": "in_progress", "role": "assistant",
                        "content": []}))
                    out.append(event("response.content_part.added", **item, content_index=0,
                                     part=OutputText(text="").model_dump()))
                if delta:
                    text.append(delta)
                    out.append(event("response.output_text.delta", **item, content_index=0, delta=delta, logprobs=[]))
                finish_reason = choice.get("finish_reason") or finish_reason
            if chunk.get("usage") is not None and not chunk["choices"]:
                final = _response(body, response_id, model, created, "".join(text), finish_reason, chunk["usage"])
                message = final.output[0]
                out.append(event("response.output_text.done", **item, content_index=0, text="".join(text), logprobs=[]))
                out.append(event("response.content_part.done", **item, content_index=0,
                                 part=message.content[0].model_dump()))
                out.append(event("response.output_item.done", output_index=0, item=message.model_dump()))
                # vLLM ends every stream with response.completed; the response's status says whether
                # max_output_tokens cut it short.
                out.append(event("response.completed", response=final.model_dump(mode="json")))
        if out:
            yield "".join(out)
