"""OpenAI-compatible endpoints over the same queue as POST /generate: GET /v1/models,
POST /v1/completions and POST /v1/chat/completions, streaming or not.

They only translate: a request becomes the GenerateRequest that POST /generate would take
(chat messages through the checkpoint's chat template), enqueued as the same RQ job; the
job's GenerationResult, or its stream of deltas, becomes OpenAI's response. `OpenAITranslator`
is also what turns batch lines into jobs and job results into batch output lines.

A non-streaming request waits for its job up to `completion_timeout_s`; after that the job
is canceled and the answer is a 504. A client that disconnects, streaming or not, cancels
its job (as vLLM aborts the request), so an impatient client's retries do not pile up work.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from api.auth import authenticate
from api.errors import ApiError, describe_validation_errors, first_field, openai_error_body
from api.jobs import AlreadyFinished, JobStore, QueueFull
from api.openai_schemas import ChatCompletionRequest, CompletionRequest
from api.prompts import PromptChecker
from api.threads import blocking
from pagedq.protocol import Completion, GenerateRequest, GenerationResult
from pagedq.redis_schema import TERMINAL, JobState
from pagedq.settings import Settings

Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
COMPLETIONS: Endpoint = "/v1/completions"
CHAT: Endpoint = "/v1/chat/completions"
REQUEST_MODELS = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest}
OpenAIRequest = CompletionRequest | ChatCompletionRequest
# How often a waiting non-streaming request looks whether its client is still there.
_DISCONNECT_CHECK_S = 1.0

router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)], tags=["OpenAI-compatible"])


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class OpenAITranslator:
    """OpenAI requests to the service's requests, job results to OpenAI responses."""

    def __init__(self, settings: Settings, checker: PromptChecker):
        self.checker = checker
        self.model_id = settings.model_id
        model = settings.require_model()
        self.model_names = {self.model_id, model, str(Path(model).resolve())}
        self.created = int(time.time())

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "pagedq",
                "max_model_len": self.checker.max_model_len}

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_id}` (GET /v1/models)",
                           param="model", code="model_not_found")

    def parse(self, endpoint: Endpoint, body: dict) -> OpenAIRequest:
        """A body of `endpoint` (a batch line's), validated as the endpoint itself would; ApiError(400) if not."""
        try:
            return REQUEST_MODELS[endpoint].model_validate(body)
        except ValidationError as exc:
            raise ApiError(400, describe_validation_errors(exc.errors()), param=first_field(exc.errors())) from None

    def prepare(self, endpoint: Endpoint, body: OpenAIRequest) -> tuple[GenerateRequest, list[int]]:
        """The GenerateRequest and prompt token ids of a validated body; ApiError (404, 400) for what cannot run."""
        self.check_model(body.model)
        try:
            if endpoint == CHAT:
                messages = [message.template_dict() for message in body.messages]
                request = body.generate_request(self.checker.chat_token_ids(messages, body.add_generation_prompt))
            else:
                request = body.generate_request()
            return request, self.checker.prompt_token_ids(request)
        except ValidationError as exc:
            raise ApiError(400, describe_validation_errors(exc.errors()), param=first_field(exc.errors())) from None
        except ValueError as exc:
            message = str(exc)
            param = message.partition(":")[0] if ":" in message and " " not in message.partition(":")[0] else None
            raise ApiError(400, message, param=param) from None

    # ---- responses ----------------------------------------------------------------------

    def response(self, endpoint: Endpoint, seq_id: str, result: GenerationResult, top_logprobs: int | None) -> dict:
        """OpenAI's response body for a finished job: a choice per output. `top_logprobs`:
        the job's SamplingParams.logprobs (chat lists that many alternatives per token)."""
        created = int(result.timings.enqueued or time.time())
        usage = _usage(result.usage.prompt_tokens, result.usage.completion_tokens)
        if endpoint == COMPLETIONS:
            choices = [
                {"index": output.index, "text": output.text, "logprobs": self._completion_logprobs(output),
                 "finish_reason": output.finish_reason, "stop_reason": output.stop_reason}
                for output in result.outputs
            ]
            return {"id": f"cmpl-{seq_id}", "object": "text_completion", "created": created, "model": self.model_id,
                    "choices": choices, "usage": usage}
        choices = [
            {"index": output.index, "message": {"role": "assistant", "content": output.text},
             "logprobs": self._chat_logprobs(output, top_logprobs or 0) if top_logprobs is not None else None,
             "finish_reason": output.finish_reason, "stop_reason": output.stop_reason}
            for output in result.outputs
        ]
        return {"id": f"chatcmpl-{seq_id}", "object": "chat.completion", "created": created, "model": self.model_id,
                "choices": choices, "usage": usage}

    def _steps(self, output: Completion) -> list[tuple[str, float, list[tuple[str, float]]]]:
        """Per generated token: its text, its logprob, and the alternatives (text, logprob) best first."""
        ranked = [sorted(((int(i), lp) for i, lp in step.items()), key=lambda item: -item[1]) for step in output.logprobs]
        ids = sorted({token_id for step in ranked for token_id, _ in step} | set(output.token_ids))
        texts = dict(zip(ids, self.checker.token_texts(ids)))
        return [
            (texts[token_id], step[str(token_id)], [(texts[i], lp) for i, lp in alternatives])
            for token_id, step, alternatives in zip(output.token_ids, output.logprobs, ranked)
        ]

    def _completion_logprobs(self, output: Completion) -> dict | None:
        if output.logprobs is None:
            return None
        steps = self._steps(output)
        offsets, offset = [], 0
        for text, _, _ in steps:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": [text for text, _, _ in steps], "token_logprobs": [lp for _, lp, _ in steps],
                "top_logprobs": [dict(alternatives) for _, _, alternatives in steps], "text_offset": offsets}

    def _chat_logprobs(self, output: Completion, top_logprobs: int) -> dict | None:
        if output.logprobs is None:
            return None

        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [
            {**entry(text, lp), "top_logprobs": [entry(t, alp) for t, alp in alternatives[:top_logprobs]]}
            for text, lp, alternatives in self._steps(output)
        ]}


# ---- endpoints ----------------------------------------------------------------------------


def _translator(request: Request) -> OpenAITranslator:
    return request.app.state.openai


@router.get("/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_translator(request).model_card()]}


@router.get("/models/{model:path}")
async def get_model(model: str, request: Request) -> dict:
    translator = _translator(request)
    translator.check_model(model)
    return translator.model_card()


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, api_key: Annotated[str, Depends(authenticate)]):
    return await _serve(request, COMPLETIONS, body, api_key)


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, api_key: Annotated[str, Depends(authenticate)]):
    return await _serve(request, CHAT, body, api_key)


async def _serve(request: Request, endpoint: Endpoint, body: OpenAIRequest, api_key: str) -> JSONResponse | StreamingResponse:
    translator = _translator(request)
    store: JobStore = request.app.state.store
    settings: Settings = request.app.state.settings

    def submit() -> tuple[str, GenerateRequest]:
        generate, prompt_token_ids = translator.prepare(endpoint, body)
        seq_id, _ = store.submit(generate, prompt_token_ids, None, api_key, stream=body.stream)
        return seq_id, generate

    try:
        seq_id, generate = await blocking(request, submit)
    except QueueFull as exc:
        raise ApiError(429, str(exc), {"Retry-After": str(settings.retry_after_s)}) from exc
    if body.stream:
        return StreamingResponse(
            _stream(request, endpoint, seq_id, generate.n, body.include_usage),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    state = await _wait(request, seq_id, settings.completion_timeout_s)
    if state not in TERMINAL:
        try:
            await blocking(request, store.cancel, seq_id)
        except AlreadyFinished:
            pass  # it ended just now: answer it
        else:
            raise ApiError(504, f"job {seq_id} did not finish within {settings.completion_timeout_s:g}s "
                           "(PAGEDQ_COMPLETION_TIMEOUT_S) and was canceled; stream, or use the Batch API, for long work",
                           code="timeout")
    state, result, error = await blocking(request, store.outcome, seq_id)
    if state == "failed":
        raise ApiError(500, f"job {seq_id} failed: {error}", code="job_failed")
    if result is None:
        raise ApiError(409, f"job {seq_id} was {state or 'deleted'} before it finished", code="canceled")
    return JSONResponse(translator.response(endpoint, seq_id, result, generate.logprobs))


async def _wait(request: Request, seq_id: str, timeout_s: float) -> JobState | None:
    """The job's state once it ends or `timeout_s` passes; a client that has gone away
    stops the wait (and the job) early."""
    streams = request.app.state.streams
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        await streams.wait_until_done(seq_id, min(remaining, _DISCONNECT_CHECK_S))
        state = await streams.state(seq_id)
        if state is None or state in TERMINAL or await request.is_disconnected():
            return state
    return await streams.state(seq_id)


def _cancel_in_background(request: Request, seq_id: str) -> None:
    """Cancel from a response being torn down (the client left): not awaited."""
    store: JobStore = request.app.state.store

    def cancel() -> None:
        try:
            store.cancel(seq_id)
        except AlreadyFinished:
            pass

    asyncio.get_running_loop().run_in_executor(None, cancel)


async def _stream(request: Request, endpoint: Endpoint, seq_id: str, n: int, include_usage: bool) -> AsyncIterator[str]:
    """The job's deltas as OpenAI chunks (a choice per output index), then `data: [DONE]`.
    A job retried after its worker died starts over: each output's new text is checked
    against what the client already has and only the rest is sent (greedy and seeded
    requests repeat themselves); should one differ, the stream ends with an error."""
    translator = _translator(request)
    store: JobStore = request.app.state.store
    chat = endpoint == CHAT
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{seq_id}", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": translator.model_id}

    def chunk(index: int, text: str | None, finish_reason: str | None = None) -> str:
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return _sse({**base, "choices": [choice]})

    def error(message: str, code: str) -> str:
        return _sse(openai_error_body(500, message, code=code)) + _sse("[DONE]")

    done = False
    sent: dict[int, str] = {}
    # A retried attempt's text so far, per output still behind what was sent.
    retry: dict[int, str] = {}
    try:
        if chat:
            yield "".join(_sse({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]}) for index in range(n))
        async for events in request.app.state.streams.relay(seq_id):
            out = []
            for kind, data, _ in events:
                if kind == "reset":
                    retry = dict.fromkeys(range(n), "")
                elif kind == "delta":
                    index, text = data.get("index", 0), data["text"]
                    already = sent.get(index, "")
                    if index in retry:
                        redone = retry[index] + text
                        if not (already.startswith(redone) or redone.startswith(already)):
                            yield "".join(out) + error(f"job {seq_id} was rerun after its worker failed and its text "
                                                       "differs from what was streamed; retry the request", "rerun_diverged")
                            return
                        if len(redone) <= len(already):
                            retry[index] = redone
                            continue
                        text = redone[len(already):]
                        del retry[index]
                    if text:
                        sent[index] = already + text
                        out.append(chunk(index, text))
                elif kind == "end":
                    done = True
                    state, result, failure = await blocking(request, store.outcome, seq_id)
                    if result is None:
                        out.append(error(f"job {seq_id} {state}: {failure or 'canceled'}", f"job_{state}"))
                    else:
                        out += [chunk(output.index, None, output.finish_reason) for output in result.outputs]
                        if include_usage:
                            usage = _usage(result.usage.prompt_tokens, result.usage.completion_tokens)
                            out.append(_sse({**base, "choices": [], "usage": usage}))
                        out.append(_sse("[DONE]"))
            if out:
                yield "".join(out)
    finally:
        if not done:
            _cancel_in_background(request, seq_id)
