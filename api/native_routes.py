"""The native routes: POST /generate, GET|DELETE /result/{id}, GET /stream/{id} (SSE),
GET /health, GET /ready, GET /metrics. What they share (the job store, the stream reader,
the prompt checker, settings, metrics) is on `request.app.state`, set by api.app.create_app."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis import Redis
from redis.exceptions import RedisError

from api.auth import Caller, authenticate, authenticate_probe
from api.errors import REDIS_RETRY_AFTER_S, ApiError, check_idempotency_key, error_response, idempotency_conflict
from api.jobs import AlreadyFinished, IdempotencyConflict, JobStore, PreparedJob, QueueFull
from api.prompts import PromptChecker, tokenized_inline
from api.streaming import StreamReader, valid_stream_id
from api.threads import blocking
from pagedq.live_workers import live_workers
from pagedq.metrics import CONTENT_TYPE
from pagedq.protocol import SEQ_ID_PATTERN, ErrorResponse, GenerateRequest, ResultResponse, SubmitResponse
from pagedq.redis_connection import passing_redis_trouble
from pagedq.redis_schema import READY_PROBE_KEY, READY_PROBE_TTL_S

# Who calls (api.auth.ANYONE with auth off); module-level so FastAPI can resolve the annotation.
Auth = Annotated[Caller, Depends(authenticate)]
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 422, 429, 503)}

router = APIRouter()


def _check_seq_id(seq_id: str) -> str:
    if not SEQ_ID_PATTERN.match(seq_id):
        raise ApiError(404, f"no job {seq_id!r}")
    return seq_id


@router.post("/generate", status_code=202, response_model=SubmitResponse, responses=_ERRORS)
async def generate(
    body: GenerateRequest,
    request: Request,
    caller: Auth,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> SubmitResponse:
    check_idempotency_key(idempotency_key)
    store: JobStore = request.app.state.store
    checker: PromptChecker = request.app.state.prompts

    def prepare() -> PreparedJob:
        try:
            prompt_token_ids = checker.prompt_token_ids(body)
        except ValueError as exc:
            raise ApiError(422, str(exc)) from exc
        return store.prepare(checker.with_generation_defaults(body), prompt_token_ids, idempotency_key, caller.tenant)

    # A long text prompt is tokenized in a thread, a chat's template applied there too.
    inline = body.messages is None and tokenized_inline([body.prompt_token_ids or body.prompt or ""])
    prepared = prepare() if inline else await blocking(request, prepare)
    try:
        status = store.settle(prepared, await store.enqueue(request.app.state.round_trip, prepared))
        if status is None:
            status = await blocking(request, store.replay, prepared)
    except QueueFull as exc:
        raise ApiError(429, str(exc), {"Retry-After": str(request.app.state.settings.retry_after_s)}) from exc
    except IdempotencyConflict as exc:
        raise idempotency_conflict(str(exc)) from exc
    return SubmitResponse(seq_id=prepared.seq_id, status=status, result_url=result_url(request, prepared.seq_id))


def result_url(request: Request, seq_id: str) -> str:
    """GET /result's address for the job, as request.url_for() gives it without its search
    through every route (a tenth of a POST's cost)."""
    return f"{request.base_url}result/{seq_id}"

@router.get("/result/{seq_id}", response_model=ResultResponse, responses=_ERRORS)
async def result(
    seq_id: str,
    request: Request,
    caller: Auth,
    wait: Annotated[float, Query(ge=0, description="Seconds to wait for the job to end (bounded).")] = 0,
) -> ResultResponse:
    _check_seq_id(seq_id)
    store: JobStore = request.app.state.store
    streams: StreamReader = request.app.state.streams
    if wait > 0:
        await streams.wait_until_done(seq_id, min(wait, request.app.state.settings.max_wait_s), caller)
    stored = await store.read(request.app.state.round_trip, seq_id, caller)
    if stored is None:
        raise ApiError(404, f"no job {seq_id!r}")
    # A finished job's answer is all in what was read; any other reads its stream, in a thread.
    return store.snapshot_of(stored) if stored.state == "finished" else await blocking(request, store.snapshot_of, stored)

@router.delete("/result/{seq_id}", response_model=ResultResponse, responses=_ERRORS)
async def cancel(seq_id: str, request: Request, caller: Auth) -> ResultResponse:
    _check_seq_id(seq_id)
    try:
        snapshot = await blocking(request, request.app.state.store.cancel, seq_id, caller)
    except AlreadyFinished as exc:
        raise ApiError(409, str(exc)) from exc
    if snapshot is None:
        raise ApiError(404, f"no job {seq_id!r}")
    return snapshot

@router.get("/stream/{seq_id}", responses=_ERRORS, response_class=StreamingResponse)
async def stream(
    seq_id: str,
    request: Request,
    caller: Auth,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    _check_seq_id(seq_id)
    if last_event_id is not None and not valid_stream_id(last_event_id):
        raise ApiError(400, "Last-Event-ID: expected an event id like '1700000000000-0'")
    streams: StreamReader = request.app.state.streams
    if await streams.visible_state(seq_id, caller) is None:
        raise ApiError(404, f"no job {seq_id!r}")
    return StreamingResponse(
        streams.events(seq_id, last_event_id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )

@router.get("/health")
async def health() -> dict:
    # On the event loop: a plain `def` route takes a trip through anyio's thread pool
    # (~200 us more of the api's CPU per probe here, and a wait behind busy threads).
    return {"status": "ok"}

Probe = Annotated[Caller, Depends(authenticate_probe)]


@router.get("/metrics", response_class=Response)
async def prometheus_metrics(request: Request, caller: Probe) -> Response:
    if not caller.admin:
        raise ApiError(403, "metrics span every tenant: they need an admin key (PAGEDQ_ADMIN_API_KEYS)")
    return Response(await blocking(request, request.app.state.metrics.exposition), media_type=CONTENT_TYPE)

@router.get("/ready", responses={503: {"model": ErrorResponse}})
async def ready(request: Request, caller: Probe) -> JSONResponse:
    # Redis unreachable: 503 from the error handler.
    queue = request.app.state.store.queue
    connection = request.app.state.redis
    try:
        await blocking(request, connection.set, READY_PROBE_KEY, "1", READY_PROBE_TTL_S)
    except RedisError as exc:
        if (trouble := passing_redis_trouble(exc)) is None or trouble == "is unreachable":
            raise
        return error_response(503, f"Redis {trouble}: it refuses writes, so no job can be queued or finished",
                              {"Retry-After": str(REDIS_RETRY_AFTER_S)})
    workers, queue_depth = await blocking(request, _live_workers, connection, queue)
    if not workers:
        return error_response(503, f"no live worker on queue {request.app.state.settings.queue_name!r}")
    if not caller.admin:
        return JSONResponse({"status": "ready"})  # the queue and the engines hold every tenant's work
    return JSONResponse({"status": "ready", "queue_depth": queue_depth, "workers": workers})


def _live_workers(connection: Redis, queue) -> tuple[list[dict], int]:
    """The queue's live workers (with their engine stats) and its depth."""
    return live_workers(connection, queue), queue.count
