"""The pagedq HTTP api (FastAPI). `create_app(settings)`; served by `pagedq api` / `pagedq up`.

POST /generate → 202 {seq_id}; GET /result/{id}[?wait=s]; DELETE /result/{id} (cancel);
GET /stream/{id} (SSE); GET /health; GET /ready; GET /metrics (Prometheus); /docs.
OpenAI-compatible, over the same queue: /v1/models, /v1/completions, /v1/chat/completions
(api/openai_compat.py) and the Batch API, /v1/files and /v1/batches (api/files.py, api/batches.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from contextlib import asynccontextmanager, suppress
from typing import Annotated

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis import Redis
from rq import worker_registration
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import batches, files, openai_compat
from api.auth import authenticate
from api.body_limit import BodySizeLimit
from api.errors import ApiError, error_response, install_error_handlers
from api.files import MULTIPART_OVERHEAD_BYTES, FileStore
from api.jobs import AlreadyFinished, IdempotencyConflict, JobStore, QueueFull
from api.prompts import PromptChecker
from api.streaming import STREAM_ID_PATTERN, StreamReader
from api.threads import blocking, blocking_limiter
from pagedq.metrics import CONTENT_TYPE, ApiMetrics
from pagedq.protocol import SEQ_ID_PATTERN, ErrorResponse, GenerateRequest, ResultResponse, SubmitResponse
from pagedq.redis_connection import connect, connect_async
from pagedq.settings import Settings

_IDEMPOTENCY_KEY_PATTERN = re.compile(r"^[\x21-\x7e]{1,255}$")
# The caller's API key ("" with auth off); module-level so FastAPI can resolve the annotation.
Auth = Annotated[str, Depends(authenticate)]
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 422, 429, 503)}
# Longer than any blocking read the api makes (StreamReader.poll_s).
_REDIS_TIMEOUTS = {"socket_connect_timeout": 2.0, "socket_timeout": 5.0}


class RequestMetrics:
    """ASGI middleware: count and time every HTTP request by route template and status."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            # The route's template, not the path: ids would make a metric per job.
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.request_duration.labels(route).observe(time.perf_counter() - started)


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
        # Bounded pools that make a request wait for a free connection: redis-py's default
        # pool fails the 101st concurrent command ("Too many connections"), which a few
        # hundred open streams reach.
        pool = {"max_connections": settings.redis_max_connections, "timeout": settings.redis_pool_timeout_s}
        redis = app.state.redis = connect(redis_url, **pool, **_REDIS_TIMEOUTS)
        app.state.aredis = connect_async(redis_url, **pool, **_REDIS_TIMEOUTS)
        store = app.state.store = JobStore(
            redis, settings, on_enqueued=lambda queue, count: metrics.jobs_submitted.labels(queue).inc(count)
        )
        app.state.streams = StreamReader(app.state.aredis)
        app.state.blocking = blocking_limiter()
        app.state.files = FileStore(redis, settings)
        app.state.batches = batches.BatchStore(redis, settings, store, app.state.files, app.state.openai)
        supervisor = asyncio.create_task(batches.supervise(app))
        yield
        supervisor.cancel()
        with suppress(asyncio.CancelledError):
            await supervisor
        await app.state.streams.hub.close()
        await app.state.aredis.aclose()
        redis.close()

    def queue_depths() -> dict[str, int]:
        store: JobStore = app.state.store
        return {queue.name: queue.count for queue in (store.queue, store.batch_queue)}

    metrics = ApiMetrics(queue_depths)
    app = FastAPI(title="pagedq", description=__doc__, lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.openai = openai_compat.OpenAITranslator(settings, checker)
    app.add_middleware(
        BodySizeLimit, max_bytes=settings.max_body_bytes,
        per_path={"/v1/files": settings.max_file_bytes + MULTIPART_OVERHEAD_BYTES},
    )
    app.add_middleware(RequestMetrics, metrics=metrics)
    install_error_handlers(app)
    for router in (openai_compat.router, files.router, batches.router):
        app.include_router(router, responses={code: {"description": "OpenAI's error object"} for code in (400, 401, 404, 409)})

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
            seq_id, status = await blocking(request, submit)
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
        snapshot = await blocking(request, store.snapshot, seq_id)
        if snapshot is None:
            raise ApiError(404, f"no job {seq_id!r}")
        return snapshot

    @app.delete("/result/{seq_id}", response_model=ResultResponse, responses=_ERRORS)
    async def cancel(seq_id: str, request: Request, api_key: Auth) -> ResultResponse:
        _check_seq_id(seq_id)
        try:
            snapshot = await blocking(request, request.app.state.store.cancel, seq_id)
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

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics(request: Request) -> Response:
        return Response(await blocking(request, metrics.exposition), media_type=CONTENT_TYPE)

    @app.get("/ready", responses={503: {"model": ErrorResponse}})
    async def ready(request: Request) -> JSONResponse:
        # Redis unreachable: 503 from the error handler.
        queue = request.app.state.store.queue
        workers, queue_depth = await blocking(request, _live_workers, request.app.state.redis, queue)
        if not workers:
            return error_response(503, f"no live worker on queue {settings.queue_name!r}")
        return JSONResponse({"status": "ready", "queue_depth": queue_depth, "workers": workers})

    return app


def _live_workers(connection: Redis, queue) -> tuple[list[dict], int]:
    """The queue's live workers (with their engine stats) and its depth."""
    keys = sorted(worker_registration.get_keys(queue=queue))
    with connection.pipeline(transaction=False) as pipeline:
        for key in keys:
            pipeline.hmget(key, "state", "death", "engine_stats", "metrics_port")
        rows = pipeline.execute()
    workers = []
    for key, (state, death, engine_stats, metrics_port) in zip(keys, rows):
        if state is None or death is not None:
            continue  # expired (no heartbeat) or shut down
        workers.append({
            "name": key.split(":", 2)[-1],
            "state": state.decode(),
            "engine": json.loads(engine_stats) if engine_stats else None,
            "metrics_port": int(metrics_port) if metrics_port else None,
        })
    return workers, queue.count
