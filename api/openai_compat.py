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
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from api.auth import ANYONE, Caller, authenticate
from api.errors import (
    ApiError,
    bad_request,
    check_idempotency_key,
    idempotency_conflict,
    named_field,
    openai_error_body,
)
from pagedq.redis_connection import passing_redis_trouble
from api.jobs import AlreadyFinished, IdempotencyConflict, JobStore, QueueFull, invalid_input
from api.openai_schemas import COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from api.prompts import PromptChecker, tokenized_inline
from api.threads import blocking
from api.tool_calls import choice as tool_choice
from api.tool_calls.deltas import OutputDeltas
from pagedq.protocol import GenerateRequest, GenerationResult
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
        # vLLM's --enable-auto-tool-choice --tool-call-parser: who parses tool_choice "auto".
        self.auto_tool_parser = settings.tool_call_parser if settings.enable_auto_tool_choice else None

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "pagedq",
                "max_model_len": self.checker.max_model_len}

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_id}` (GET /v1/models)",
                           param="model", code="model_not_found")

    def parse(self, endpoint: Endpoint, body: dict) -> OpenAIRequest:
        """A body of `endpoint` (a batch line's), validated as the endpoint itself would; ApiError(400) if not."""
        try:
            return REQUEST_MODELS[endpoint].model_validate(body)
        except ValidationError as exc:
            raise bad_request(exc) from None

    def prepare(self, endpoint: Endpoint, body: OpenAIRequest) -> list[tuple[GenerateRequest, list[int]]]:
        """The GenerateRequest and prompt token ids of each of a validated body's prompts (a
        completion may list several); ApiError (404, 400) for what cannot run."""
        self.check_model(body.model)
        try:
            if endpoint == CHAT:
                tools = self.tool_plan(body)
                messages = [message.template_dict() for message in body.messages]
                functions = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
                prompt = self.checker.chat_token_ids(messages, body.add_generation_prompt, body.chat_template_kwargs,
                                                     tools=functions)
                requests = body.generate_requests(prompt, tools.sampling_overrides if tools else None)
            else:
                requests = body.generate_requests()
            return [self._prepared(request, body) for request in requests]
        except ValueError as exc:  # a pydantic ValidationError too
            error = bad_request(exc)
        if body.use_beam_search and error.param == "beam_width":
            # The width of a beam search is OpenAI's `n` (generate_requests renames it): name what the client sent.
            error = ApiError(400, "n" + str(error.detail).removeprefix("beam_width"), param="n")
        raise error

    def _prepared(self, request: GenerateRequest, body: OpenAIRequest) -> tuple[GenerateRequest, list[int]]:
        request = self.checker.with_generation_defaults(request)
        ids = self.checker.prompt_token_ids(request, body.truncate_prompt_tokens)
        if body.truncate_prompt_tokens is not None:
            # The job runs the kept tokens; the text they came from is no longer its prompt.
            request = request.model_copy(update={"prompt": None, "prompt_token_ids": ids})
        if isinstance(body, CompletionRequest) and request.max_tokens is None:
            # vLLM's: OpenAI's 16 tokens, or what the context leaves when that is less.
            request.max_tokens = min(COMPLETION_MAX_TOKENS, self.checker.max_model_len - len(ids))
        return request, ids

    def echo_texts(self, jobs: list[tuple[GenerateRequest, list[int]]]) -> list[str]:
        """What echo puts before each prompt's choices: the prompt as sent, or its tokens' text."""
        with self.checker.borrowed() as tokenizer:
            return [request.prompt if request.prompt is not None else tokenizer.decode(ids) for request, ids in jobs]

    def tool_plan(self, body: OpenAIRequest) -> tool_choice.ToolPlan | None:
        """What a chat body's tools ask for (None: plain content); ApiError(400) naming the field."""
        if not isinstance(body, ChatCompletionRequest):
            return None
        try:
            return tool_choice.plan(body.tools, body.tool_choice, self.auto_tool_parser)
        except ValueError as exc:
            raise bad_request(exc) from None

    # ---- responses ----------------------------------------------------------------------

    def response(self, endpoint: Endpoint, seq_id: str, results: list[GenerationResult], top_logprobs: int | None,
                 prompt_token_ids: list[list[int]] | None = None, echo: list[str] | None = None,
                 return_token_ids: bool = False, prompt_logprobs: int | None = None,
                 tools: tool_choice.ToolPlan | None = None) -> dict:
        """OpenAI's response body for finished jobs (one per prompt): a choice per output,
        indexed as OpenAI does (prompt by prompt, each prompt's n outputs in turn); usage
        summed. `top_logprobs`: the jobs' SamplingParams.logprobs (chat lists that many
        alternatives per token). `prompt_token_ids`: each prompt's, which `echo` (each
        prompt's text, put before its choices' text: completions) and vLLM's
        `return_token_ids` (the prompt's and each choice's token ids in the response) need.
        `prompt_logprobs`: the jobs' SamplingParams.prompt_logprobs (vLLM's prompt_logprobs
        in the response: each completion choice's, chat's beside its choices). `tools`: the
        chat request's ToolPlan (its text parsed into calls)."""
        created = int(results[0].timings.enqueued or time.time())
        usage = _usage(sum(r.usage.prompt_tokens for r in results), sum(r.usage.completion_tokens for r in results))
        indexed = [(offset + output.index, prompt, result, output)
                   for prompt, (offset, result) in enumerate(zip(_choice_offsets(results), results))
                   for output in result.outputs]
        if endpoint == COMPLETIONS:
            choices = []
            for index, prompt, result, output in indexed:
                text, logprobs = output.text, self.completion_logprobs(output.token_ids, output.logprobs)
                if echo is not None:
                    text = echo[prompt] + text
                    if output.logprobs is not None:
                        logprobs = self.completion_logprobs(
                            [*prompt_token_ids[prompt], *output.token_ids], [*result.prompt_logprobs, *output.logprobs])
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": output.finish_reason,
                          "stop_reason": output.stop_reason}
                if return_token_ids:
                    choice.update(prompt_token_ids=prompt_token_ids[prompt], token_ids=output.token_ids)
                if prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.ranked_prompt_logprobs(
                        result.prompt_logprobs, prompt_token_ids[prompt], prompt_logprobs)
                choices.append(choice)
            return {"id": f"cmpl-{seq_id}", "object": "text_completion", "created": created, "model": self.model_id,
                    "choices": choices, "usage": usage}
        choices = []
        for index, _, _, output in indexed:
            message, finish_reason = ({"role": "assistant", "content": output.text}, output.finish_reason) if tools is None \
                else tools.message(output.text, output.finish_reason, tool_choice.output_key(seq_id, index))
            choices.append({
                "index": index, "message": message,
                "logprobs": self.chat_logprobs(output.token_ids, output.logprobs, top_logprobs or 0)
                if top_logprobs is not None else None,
                "finish_reason": finish_reason, "stop_reason": output.stop_reason,
                **({"token_ids": output.token_ids} if return_token_ids else {}),
            })
        body = {"id": f"chatcmpl-{seq_id}", "object": "chat.completion", "created": created, "model": self.model_id,
                "choices": choices, "usage": usage}
        if return_token_ids:
            body["prompt_token_ids"] = prompt_token_ids[0]  # vLLM's: a chat request has one prompt
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = self.ranked_prompt_logprobs(
                results[0].prompt_logprobs, prompt_token_ids[0], prompt_logprobs)
        return body

    def ranked_prompt_logprobs(self, steps: list[dict[str, float] | None], prompt_token_ids: list[int],
                               alternatives: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token (None for the first), {token id: {logprob,
        rank, decoded_token}}, the prompt's own token first, then the top `alternatives`; the
        own token's rank is unknown (None) when it is not among the top ones."""
        ids = sorted({int(token_id) for step in steps if step for token_id in step})
        texts = dict(zip(ids, self.checker.token_texts(ids)))
        ranked = []
        for step, own in zip(steps, prompt_token_ids):
            if step is None:
                ranked.append(None)
                continue
            ranks = {token_id: rank for rank, (token_id, _) in enumerate(sorted(step.items(), key=lambda item: -item[1]), 1)}
            order = sorted(step, key=lambda token_id: (token_id != str(own), ranks[token_id]))
            ranked.append({token_id: {"logprob": step[token_id],
                                      "rank": ranks[token_id] if ranks[token_id] <= alternatives else None,
                                      "decoded_token": texts[int(token_id)]}
                           for token_id in order})
        return ranked

    def _steps(self, token_ids: list[int], logprobs: list[dict[str, float] | None]
               ) -> list[tuple[str, float | None, list[tuple[str, float]] | None]]:
        """Per token: its text, its logprob, and the alternatives (text, logprob) best first;
        None for a step with none (a prompt's first token, echoed)."""
        ranked = [None if step is None else sorted(((int(i), lp) for i, lp in step.items()), key=lambda item: -item[1])
                  for step in logprobs]
        ids = sorted({token_id for step in ranked for token_id, _ in step or ()} | set(token_ids))
        texts = dict(zip(ids, self.checker.token_texts(ids)))
        return [
            (texts[token_id], None, None) if step is None
            else (texts[token_id], step[str(token_id)], [(texts[i], lp) for i, lp in alternatives])
            for token_id, step, alternatives in zip(token_ids, logprobs, ranked)
        ]

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[str, float] | None] | None,
                            text_offset: int = 0) -> dict | None:
        """Completions' logprobs object for these tokens; `text_offset`: where their text starts in the choice's."""
        if logprobs is None:
            return None
        steps = self._steps(token_ids, logprobs)
        offsets, offset = [], text_offset
        for text, _, _ in steps:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": [text for text, _, _ in steps], "token_logprobs": [lp for _, lp, _ in steps],
                "top_logprobs": [None if alternatives is None else dict(alternatives) for _, _, alternatives in steps],
                "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[str, float]] | None, top_logprobs: int) -> dict | None:
        if logprobs is None:
            return None

        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [
            {**entry(text, lp), "top_logprobs": [entry(t, alp) for t, alp in alternatives[:top_logprobs]]}
            for text, lp, alternatives in self._steps(token_ids, logprobs)
        ]}


def _choice_offsets(results: list[GenerationResult]) -> list[int]:
    """The first choice index of each prompt's outputs."""
    offsets, offset = [], 0
    for result in results:
        offsets.append(offset)
        offset += len(result.outputs)
    return offsets


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
async def completions(body: CompletionRequest, request: Request, caller: Annotated[Caller, Depends(authenticate)],
                      idempotency_key: Annotated[str | None, Header()] = None):
    return await serve(request, COMPLETIONS, body, caller, idempotency_key)


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, caller: Annotated[Caller, Depends(authenticate)],
                           idempotency_key: Annotated[str | None, Header()] = None):
    return await serve(request, CHAT, body, caller, idempotency_key)


async def serve(request: Request, endpoint: Endpoint, body: OpenAIRequest, caller: Caller,
                idempotency_key: str | None = None, key_scope: str | None = None) -> JSONResponse | StreamingResponse:
    """A validated request's jobs queued, answered as the endpoint answers (also what
    /v1/responses builds on). With an `idempotency_key` (its namespace `key_scope`, by
    default the endpoint), a retry of the same body, streamed or not, answers from the same
    jobs (another body: 422, with no effect on them), and a client that goes away leaves
    them running for its retry instead of canceling them."""
    check_idempotency_key(idempotency_key)
    translator = _translator(request)
    store: JobStore = request.app.state.store
    settings: Settings = request.app.state.settings
    # Off the event loop, unless a completion's prompts are short: the prompts are tokenized,
    # a chat's template applied, a forced tool choice's schema compiled (and xgrammar may
    # still be loading).
    def plan():
        return translator.tool_plan(body), translator.prepare(endpoint, body)

    inline = isinstance(body, CompletionRequest) and tokenized_inline(body.prompts)
    tools, prompts = plan() if inline else await blocking(request, plan)
    keys: list[str | None] = [None] * len(prompts)
    body_hash = None
    if idempotency_key is not None:
        scope = key_scope or endpoint
        keys = [f"{idempotency_key}\0{scope}\0{index}" for index in range(len(prompts))]
        # Each job checks the whole body (its prompt count too), whether it streams aside.
        whole = body.model_dump_json(exclude={"stream", "stream_options"})
        body_hash = hashlib.sha256(f"{scope}\0{whole}".encode()).hexdigest()
    prepared = [store.prepare(generate, ids, key, caller.tenant, body_hash) for (generate, ids), key in zip(prompts, keys)]
    round_trip = request.app.state.round_trip
    outcomes = await asyncio.gather(*(store.enqueue(round_trip, job) for job in prepared), return_exceptions=True)
    # One job per prompt; should one not be queued, the others this request queued are
    # canceled (an Idempotency-Key's earlier jobs are the earlier request's: left alone).
    jobs: list[_Job] = []
    queued: list[str] = []
    failure: BaseException | None = None
    for job, (generate, prompt_token_ids), outcome in zip(prepared, prompts, outcomes):
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            if store.settle(job, outcome) is None:
                await blocking(request, store.replay, job)  # the key's job exists: the same body's, or a 422
            else:
                queued.append(job.seq_id)
            jobs.append(_Job(job.seq_id, generate, prompt_token_ids, len(jobs) * generate.n))
        except BaseException as exc:
            failure = failure or exc
    if failure is not None:
        await blocking(request, lambda: [_cancel(store, seq_id) for seq_id in queued])
        if isinstance(failure, QueueFull):
            raise ApiError(429, str(failure), {"Retry-After": str(settings.retry_after_s)}) from failure
        if isinstance(failure, IdempotencyConflict):
            raise idempotency_conflict(str(failure)) from failure
        raise failure
    echo = None
    if isinstance(body, CompletionRequest) and body.echo:
        echo = await blocking(request, translator.echo_texts, [(job.generate, job.prompt_token_ids) for job in jobs])
    if body.stream:
        return StreamingResponse(
            _stream(request, endpoint, jobs, body.include_usage, body.continuous_usage, tools, echo,
                    cancel_when_gone=idempotency_key is None),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    deadline = time.monotonic() + settings.completion_timeout_s
    for job in jobs:
        state = await _wait(request, job.seq_id, deadline - time.monotonic())
        if state in TERMINAL:
            continue
        if idempotency_key is not None and await request.is_disconnected():
            return JSONResponse({})  # nobody reads it; the jobs run on for the client's retry
        try:
            await blocking(request, store.cancel, job.seq_id, ANYONE)
        except AlreadyFinished:
            continue  # it ended just now: answer it
        for other in jobs:
            await blocking(request, _cancel, store, other.seq_id)
        raise ApiError(504, f"job {job.seq_id} did not finish within {settings.completion_timeout_s:g}s "
                       "(PAGEDQ_COMPLETION_TIMEOUT_S) and was canceled; stream, or use the Batch API, for long work",
                       code="timeout")
    results = []
    for job in jobs:
        state, result, error = await store.outcome(request.app.state.round_trip, job.seq_id)
        if state == "failed":
            if (invalid := invalid_input(error)) is not None:
                raise ApiError(400, invalid, param=named_field(invalid), code="invalid_request")
            raise ApiError(500, f"job {job.seq_id} failed: {error}", code="job_failed")
        if result is None:
            raise ApiError(409, f"job {job.seq_id} was {state or 'deleted'} before it finished", code="canceled")
        results.append(result)
    return JSONResponse(translator.response(
        endpoint, jobs[0].seq_id, results, jobs[0].generate.logprobs, [job.prompt_token_ids for job in jobs], echo,
        body.return_token_ids, body.prompt_logprobs, tools))


@dataclass
class _Job:
    """One prompt's job of a request; its outputs are choices `first_choice` on."""

    seq_id: str
    generate: GenerateRequest
    prompt_token_ids: list[int]
    first_choice: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def _cancel(store: JobStore, seq_id: str) -> None:
    try:
        store.cancel(seq_id, ANYONE)
    except AlreadyFinished:
        pass


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


def _cancel_in_background(request: Request, seq_ids: list[str]) -> None:
    """Cancel from a response being torn down (the client left): not awaited."""
    store: JobStore = request.app.state.store

    def cancel() -> None:
        for seq_id in seq_ids:
            _cancel(store, seq_id)

    asyncio.get_running_loop().run_in_executor(None, cancel)


class _StreamError(Exception):
    """Ends the whole response with an OpenAI error chunk."""

    def __init__(self, message: str, code: str, status: int = 500):
        super().__init__(message)
        self.code = code
        self.status = status


async def _stream(request: Request, endpoint: Endpoint, jobs: list[_Job], include_usage: bool,
                  continuous_usage: bool, tools: tool_choice.ToolPlan | None,
                  echo: list[str] | None = None, cancel_when_gone: bool = True) -> AsyncIterator[str]:
    """The jobs' deltas as OpenAI chunks (a choice per output, numbered across the jobs of
    a prompt list), then the usage chunk if asked for, then `data: [DONE]`. Every chunk
    carries `usage`: null, or with vLLM's continuous_usage_stats its choice's usage so far.
    Chat's first chunks (the role, one per choice) go out with the first output, as vLLM
    sends them: sent when the job is queued, they would make a client's time to first
    token the queueing time. With `tools` (a chat request's ToolPlan) each output's text
    goes out as content and tool-call deltas; a chunk with nothing to say yet is left out.
    `echo`: each job's prompt text, before its choices' first text. `cancel_when_gone`: the
    jobs still running when the client goes away are canceled (not for an Idempotency-Key's:
    its retry follows them)."""
    translator = _translator(request)
    chat = endpoint == CHAT
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{jobs[0].seq_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": translator.model_id}

    tool_deltas: dict[tuple[str, int], OutputDeltas] = {}

    def chunk(job: _Job, index: int, text: str | None, completion_tokens: int, logprobs: dict | None = None,
              finish_reason: str | None = None, stop_reason: int | str | None = None, role: bool = False) -> str:
        if echo is not None and (job.seq_id, index) not in echoed:
            echoed.add((job.seq_id, index))
            text = echo[jobs.index(job)] + (text or "")
        if chat:
            delta = {} if text is None else {"content": text}
            if tools is not None and not role:
                output = tool_deltas.get((job.seq_id, index))
                if output is None:
                    output = tool_deltas[job.seq_id, index] = OutputDeltas(
                        tools, tool_choice.output_key(jobs[0].seq_id, job.first_choice + index))
                delta = output.delta(text or "", final=finish_reason is not None)
                finish_reason = output.finish_reason(finish_reason)
                if not (delta or logprobs or finish_reason):
                    return ""
            choice = {"index": job.first_choice + index, "delta": {"role": "assistant", **delta} if role else delta}
        else:
            choice = {"index": job.first_choice + index, "text": text or ""}
        choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        usage = _usage(job.prompt_tokens, completion_tokens) if continuous_usage else None
        return _sse({**base, "choices": [choice], "usage": usage})

    def error(message: str, code: str, status: int = 500) -> str:
        return _sse(openai_error_body(status, message, named_field(message) if status < 500 else None, code)) + _sse("[DONE]")

    echoed: set[tuple[str, int]] = set()
    ended: set[str] = set()
    ends: dict[str, dict] = {}
    completion_tokens: dict[str, int] = {}

    async def job_texts(job: _Job) -> AsyncIterator[str]:
        """The job's chunks, then the chunk of how each of its outputs ended."""
        async for text in _job_chunks(request, job, chunk, translator, chat, ends):
            yield text
        end = ends.pop(job.seq_id, {})
        if end.get("status") == "finished" and "outputs" in end:  # how each output ended: no read of the job
            ended.add(job.seq_id)
            outputs, completion_tokens[job.seq_id] = end["outputs"], end["completion_tokens"]
        else:
            state, result, failure = await request.app.state.store.outcome(request.app.state.round_trip, job.seq_id)
            ended.add(job.seq_id)
            if (invalid := invalid_input(failure)) is not None:
                raise _StreamError(invalid, "invalid_request", 400)
            if result is None:
                raise _StreamError(f"job {job.seq_id} {state}: {failure or 'canceled'}", f"job_{state}")
            outputs = result.output_ends()
            completion_tokens[job.seq_id] = result.usage.completion_tokens
        yield "".join(
            chunk(job, index, None, num_tokens, None, finish_reason, stop_reason)
            for index, num_tokens, finish_reason, stop_reason in outputs
        )

    async def follow(job: _Job, queue: asyncio.Queue[str | Exception | None]) -> None:
        try:
            async for text in job_texts(job):
                await queue.put(text)
            await queue.put(None)
        except Exception as exc:  # ends the response, whatever it is
            await queue.put(exc)

    async def items() -> AsyncIterator[str | Exception]:
        """Every job's chunks as they come (an exception ends them). A single job's (the
        usual stream) are read here: a task of its own would cost it a task switch and a
        queue hop per chunk. A prompt list's jobs are followed by a task each, into one queue."""
        if len(jobs) == 1:
            try:
                async for text in job_texts(jobs[0]):
                    yield text
            except Exception as exc:
                yield exc
            return
        queue: asyncio.Queue[str | Exception | None] = asyncio.Queue()
        tasks = [asyncio.create_task(follow(job, queue)) for job in jobs]
        try:
            remaining = len(jobs)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    try:
        roles = "".join(chunk(job, index, "", 0, role=True) for job in jobs for index in range(job.generate.n)) \
            if chat else ""
        async with contextlib.aclosing(items()) as chunks:
            async for item in chunks:
                if isinstance(item, _StreamError):
                    yield error(str(item), item.code, item.status)
                    return
                elif isinstance(item, Exception):
                    if (trouble := passing_redis_trouble(item)) is None:
                        raise item
                    # The jobs go on: the client can retry, or read them by their seq_ids.
                    yield error(f"the job store (Redis) {trouble}: the stream cannot go on; retry later",
                                "redis_unavailable", 503)
                    return
                else:
                    yield roles + item
                    roles = ""
        tail = []
        if include_usage:
            usage = _usage(sum(job.prompt_tokens for job in jobs), sum(completion_tokens.values()))
            tail.append(_sse({**base, "choices": [], "usage": usage}))
        yield "".join(tail) + _sse("[DONE]")
    finally:
        unfinished = [job.seq_id for job in jobs if job.seq_id not in ended]
        if unfinished and cancel_when_gone:
            _cancel_in_background(request, unfinished)


async def _job_chunks(request: Request, job: _Job, chunk, translator: OpenAITranslator, chat: bool,
                      ends: dict[str, dict]) -> AsyncIterator[str]:
    """One job's deltas as chunks, until its `end` event, whose data goes to `ends`. A job
    retried after its worker died starts over: each output's new text is checked against
    what the client already has and only the rest is sent (greedy and seeded requests
    repeat themselves); should one differ, the stream ends with an error. Logprobs (when
    asked for) go out with the chunk of their tokens, each token's once."""
    sent: dict[int, str] = {}
    # A retried attempt's text so far, per output still behind what was sent.
    retry: dict[int, str] = {}
    # Per output: how many tokens' logprobs were sent, and those received but not yet sent;
    # completions' text_offset counts the sent tokens' own texts, as the non-streamed response does.
    logprobs_sent: dict[int, int] = {}
    logprobs_pending: dict[int, list] = {}
    token_text_offset: dict[int, int] = {}
    async for events in request.app.state.streams.relay(job.seq_id):
        out = []
        for kind, data, _ in events:
            if kind == "reset":
                retry = dict.fromkeys(range(job.generate.n), "")
            elif kind == "delta":
                index, text, num_tokens = data.get("index", 0), data["text"], data["num_tokens"]
                if "logprobs" in data:
                    steps = data["logprobs"]
                    first_position = num_tokens - len(steps)
                    done = logprobs_sent.get(index, 0) + len(logprobs_pending.get(index, []))
                    logprobs_pending.setdefault(index, []).extend(steps[max(done - first_position, 0):])
                already = sent.get(index, "")
                if index in retry:
                    redone = retry[index] + text
                    if not (already.startswith(redone) or redone.startswith(already)):
                        if out:
                            yield "".join(out)
                        raise _StreamError(f"job {job.seq_id} was rerun after its worker failed and its text "
                                           "differs from what was streamed; retry the request", "rerun_diverged")
                    if len(redone) <= len(already):
                        retry[index] = redone
                        continue
                    text = redone[len(already):]
                    del retry[index]
                steps = logprobs_pending.pop(index, [])
                if text or steps:
                    logprobs = None
                    if steps:
                        token_ids, step_logprobs = [t for t, _ in steps], [lp for _, lp in steps]
                        logprobs_sent[index] = logprobs_sent.get(index, 0) + len(steps)
                        if chat:
                            logprobs = translator.chat_logprobs(token_ids, step_logprobs, job.generate.logprobs)
                        else:
                            logprobs = translator.completion_logprobs(token_ids, step_logprobs, token_text_offset.get(index, 0))
                            token_text_offset[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    sent[index] = already + text
                    out.append(chunk(job, index, text, num_tokens, logprobs))
            elif kind == "end":
                ends[job.seq_id] = data
                if out:
                    yield "".join(out)
                return
        if out:
            yield "".join(out)
