"""The pagedq HTTP api (FastAPI). `create_app(settings)`; served by `pagedq api` / `pagedq up`.

POST /generate → 202 {seq_id}; GET /result/{id}[?wait=s]; DELETE /result/{id} (cancel);
GET /stream/{id} (SSE); GET /health; GET /ready; GET /metrics (Prometheus) (api/native_routes.py); /docs.
OpenAI-compatible, over the same queue: /v1/models, /v1/completions, /v1/chat/completions
(api/openai_compat.py) and the Batch API, /v1/files and /v1/batches (api/files.py, api/batches/), including summary batches (api/summaries/).
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import files, native_routes, openai_compat, responses_routes, retention, tokenize_routes
from api.batches import routes as batch_routes
from api.batches.store import BatchStore
from api.batches.supervisor import supervise
from api.auth import Keyring, install_key_redactor
from api.body_limit import BodySizeLimit
from api.docs import install_docs
from api.errors import install_error_handlers
from api.files import MULTIPART_OVERHEAD_BYTES, FileStore
from api.jobs import JobStore
from api.prompts import PromptChecker
from api.shared_round_trip import SharedRoundTrip
from api.streaming import StreamReader
from api.threads import BulkThreads, blocking_limiter
from api.turns import RequestTurns
from api.worker_metrics import WorkerSeries
from pagedq.live_workers import live_workers
from pagedq.metrics import ApiMetrics
from pagedq.gc_tuning import freeze_startup_heap
from pagedq.redis_connection import connect, connect_async
from pagedq.settings import Settings
from pagedq.structured_outputs_params import preload_grammar_engine
# The read timeout: longer than any blocking read the api makes (the stream hub's block_s).
# The connect timeout counts the event loop's lag too: a connection opened as a burst of two
# thousand requests arrives completes only after the loop has worked through the burst's
# handlers (seconds on two cores), and at 2 s such bursts got 503s from an idle Redis.
_REDIS_TIMEOUTS = {"socket_connect_timeout": 10.0, "socket_timeout": 5.0}


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
        app.state.round_trip = SharedRoundTrip(app.state.aredis)
        app.state.streams = StreamReader(app.state.aredis, app.state.round_trip)
        app.state.blocking = blocking_limiter()
        app.state.bulk = BulkThreads()
        app.state.files = FileStore(redis, settings)
        app.state.batches = BatchStore(redis, settings, store, app.state.files, app.state.openai)
        background = [asyncio.create_task(supervise(app)), asyncio.create_task(retention.keep_pruning(app))]
        checker.load_loop_tokenizer()  # on the loop's thread: short prompts are tokenized there
        # Off the event loop: requests are served while it loads.
        threading.Thread(target=preload_grammar_engine, name="preload-xgrammar", daemon=True).start()
        freeze_startup_heap()
        yield
        for task in background:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        await app.state.streams.hub.close()
        await app.state.aredis.aclose()
        redis.close()

    def queue_depths() -> dict[str, int]:
        store: JobStore = app.state.store
        return {queue.name: queue.count for queue in (store.queue, store.batch_queue)}

    def workers() -> list[dict]:
        """Each live worker once (a worker serves both queues)."""
        store: JobStore = app.state.store
        rows = (worker for queue in (store.queue, store.batch_queue) for worker in live_workers(app.state.redis, queue))
        return list({worker["name"]: worker for worker in rows}.values())

    metrics = ApiMetrics(queue_depths, WorkerSeries(workers))
    # /docs and /redoc with their scripts served from the fastapi-offline package, not a CDN.
    app = FastAPIOffline(title="pagedq", lifespan=lifespan)
    app.state.settings = settings
    app.state.keyring = Keyring(settings)
    install_key_redactor(settings)
    app.state.metrics = metrics
    app.state.prompts = checker
    app.state.openai = openai_compat.OpenAITranslator(settings, checker)
    app.add_middleware(
        BodySizeLimit, max_bytes=settings.max_body_bytes,
        per_path={"/v1/files": settings.max_file_bytes + MULTIPART_OVERHEAD_BYTES},
    )
    app.add_middleware(RequestMetrics, metrics=metrics)
    # Outermost: a request waiting for its turn has cost nothing yet.
    app.add_middleware(RequestTurns, per_turn=settings.api_requests_per_turn)
    install_error_handlers(app)
    # The native routes first: a request is matched against each route in turn, and theirs
    # are the service's busiest (a POST and a stream per job).
    app.include_router(native_routes.router)
    for router in (openai_compat.router, responses_routes.router, files.router, batch_routes.router):
        app.include_router(router, responses={code: {"description": "OpenAI's error object"} for code in (400, 401, 404, 409)})
    app.include_router(tokenize_routes.router)
    install_docs(app)

    return app


def app_from_environment() -> FastAPI:
    """The app with settings from `PAGEDQ_*` variables: each `pagedq api --workers N` process builds its own."""
    return create_app(Settings())
