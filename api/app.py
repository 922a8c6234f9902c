"""The pagedq HTTP api (FastAPI). `create_app(settings)`; served by `pagedq api` / `pagedq up`.

POST /generate → 202 {seq_id}; GET /result/{id}[?wait=s]; DELETE /result/{id} (cancel);
GET /stream/{id} (SSE); GET /health; GET /ready; /docs.
"""

from __future__ import annotations

import json
import re
from contextlib import asynccontextmanager
from typing import Annotated

import anyio
from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from rq import worker_registration

from api.auth import authenticate
from api.body_limit import BodySizeLimit
from api.errors import ApiError, error_response, install_error_handlers
from api.jobs import AlreadyFinished, IdempotencyConflict, JobStore, QueueFull
from api.prompts import PromptChecker
from api.streaming import STREAM_ID_PATTERN, StreamReader
from pagedq.protocol import SEQ_ID_PATTERN, ErrorResponse, GenerateRequest, ResultResponse, SubmitResponse
from pagedq.settings import Settings

_IDEMPOTENCY_KEY_PATTERN = re.compile(r"^[\x21-\x7e]{1,255}$")
# The caller's API key ("" with auth off); module-level so FastAPI can resolve the annotation.
Auth = Annotated[str, Depends(authenticate)]
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 422, 429, 503)}
# Longer than any blocking read the api makes (StreamReader.poll_s).
_REDIS_TIMEOUTS = {"socket_connect_timeout": 2.0, "socket_timeout": 5.0}
# Blocking work (RQ's sync Redis calls, the tokenizer) runs in threads, this many at once:
# with one thread per request, a burst of submissions shares the GIL round-robin and is
# answered all together at the end; a few threads answer it in arrival order, so the
# first jobs start running while later ones are still arriving.
_BLOCKING_THREADS = 4


async def _blocking(request: Request, function, *args):
    return await anyio.to_thread.run_sync(function, *args, limiter=request.app.state.blocking)


def _check_seq_id(seq_id: str) -> str:
    if not SEQ_ID_PATTERN.match(seq_id):
        raise ApiError(404, f"no job {seq_id!r}")
    return seq_id


def create_app(settings: Settings) -> FastAPI:
    redis_url = settings.require_redis_url()
    checker = PromptChecker(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Bounded timeouts: a Redis that hangs must turn into a 503, not a hung request.
        app.state.redis = Redis.from_url(redis_url, **_REDIS_TIMEOUTS)
        app.state.aredis = AsyncRedis.from_url(redis_url, **_REDIS_TIMEOUTS)
        app.state.store = JobStore(app.state.redis, settings)
        app.state.streams = StreamReader(app.state.aredis)
        app.state.blocking = anyio.CapacityLimiter(_BLOCKING_THREADS)
        yield
        await app.state.streams.hub.close()
        await app.state.aredis.aclose()
        app.state.redis.close()

    app = FastAPI(title="pagedq", description=__doc__, lifespan=lifespan)
    app.state.settings = settings
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    install_error_handlers(app)

    @app.post("/generate", status_code=202, response_model=SubmitResponse, responses=_ERRORS)
    async def generate(
        body: GenerateRequest,
        request: Request,
        api_key: Auth,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> SubmitResponse:
        if idempotency_key is not None and not _IDEMPOTENCY_KEY_PATTERN.match(idempotency_key):
            raise ApiError(400, "Idempotency-Key: 1 to 255 printable ASCII characters, no spaces")
        store: JobStore = request.app.state.store

        def submit() -> tuple[str, str]:
            try:
                prompt_token_ids = checker.prompt_token_ids(body)
            except ValueError as exc:
                raise ApiError(422, str(exc)) from exc
            return store.submit(body, prompt_token_ids, idempotency_key, api_key)

        try:
            seq_id, status = await _blocking(request, submit)
        except QueueFull as exc:
            raise ApiError(429, str(exc), {"Retry-After": str(settings.retry_after_s)}) from exc
        except IdempotencyConflict as exc:
            raise ApiError(422, str(exc)) from exc
        return SubmitResponse(seq_id=seq_id, status=status, result_url=str(request.url_for("result", seq_id=seq_id)))

    @app.get("/result/{seq_id}", response_model=ResultResponse, responses=_ERRORS)
    async def result(
        seq_id: str,
        request: Request,
        api_key: Auth,
        wait: Annotated[float, Query(ge=0, description="Seconds to wait for the job to end (bounded).")] = 0,
    ) -> ResultResponse:
        _check_seq_id(seq_id)
        store: JobStore = request.app.state.store
        if wait > 0:
            await request.app.state.streams.wait_until_done(seq_id, min(wait, settings.max_wait_s))
        snapshot = await _blocking(request, store.snapshot, seq_id)
        if snapshot is None:
            raise ApiError(404, f"no job {seq_id!r}")
        return snapshot

    @app.delete("/result/{seq_id}", response_model=ResultResponse, responses=_ERRORS)
    async def cancel(seq_id: str, request: Request, api_key: Auth) -> ResultResponse:
        _check_seq_id(seq_id)
        try:
            snapshot = await _blocking(request, request.app.state.store.cancel, seq_id)
        except AlreadyFinished as exc:
            raise ApiError(409, str(exc)) from exc
        if snapshot is None:
            raise ApiError(404, f"no job {seq_id!r}")
        return snapshot

    @app.get("/stream/{seq_id}", responses=_ERRORS, response_class=StreamingResponse)
    async def stream(
        seq_id: str,
        request: Request,
        api_key: Auth,
        last_event_id: Annotated[str | None, Header()] = None,
    ) -> StreamingResponse:
        _check_seq_id(seq_id)
        if last_event_id is not None and not re.match(STREAM_ID_PATTERN, last_event_id):
            raise ApiError(400, "Last-Event-ID: expected an event id like '1700000000000-0'")
        streams: StreamReader = request.app.state.streams
        if await streams.state(seq_id) is None:
            raise ApiError(404, f"no job {seq_id!r}")
        return StreamingResponse(
            streams.events(seq_id, last_event_id),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"model": ErrorResponse}})
    async def ready(request: Request) -> JSONResponse:
        # Redis unreachable: 503 from the error handler.
        queue = request.app.state.store.queue
        workers, queue_depth = await _blocking(request, _live_workers, request.app.state.redis, queue)
        if not workers:
            return error_response(503, f"no live worker on queue {settings.queue_name!r}")
        return JSONResponse({"status": "ready", "queue_depth": queue_depth, "workers": workers})

    return app


def _live_workers(connection: Redis, queue) -> tuple[list[dict], int]:
    """The queue's live workers (with their engine stats) and its depth."""
    keys = sorted(worker_registration.get_keys(queue=queue))
    with connection.pipeline(transaction=False) as pipeline:
        for key in keys:
            pipeline.hmget(key, "state", "death", "engine_stats")
        rows = pipeline.execute()
    workers = []
    for key, (state, death, engine_stats) in zip(keys, rows):
        if state is None or death is not None:
            continue  # expired (no heartbeat) or shut down
        workers.append({
            "name": key.split(":", 2)[-1],
            "state": state.decode(),
            "engine": json.loads(engine_stats) if engine_stats else None,
        })
    return workers, queue.count
