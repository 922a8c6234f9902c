"""POST /v1/batches, GET /v1/batches[/{id}], POST /v1/batches/{id}/cancel: the store's
refusals become OpenAI's errors here, and only here."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request

from api.auth import Caller, authenticate
from api.batches.schemas import BatchCreate, BatchRecord
from api.batches.store import BatchRefused, BatchStore
from api.errors import ApiError, check_idempotency_key
from api.threads import bulk

router = APIRouter(prefix="/v1/batches", tags=["Batch API"])
Auth = Annotated[Caller, Depends(authenticate)]


def _store(request: Request) -> BatchStore:
    return request.app.state.batches


def _found(record: BatchRecord | None, batch_id: str) -> BatchRecord:
    """The record, or 404 (for another tenant's batch too)."""
    if record is None:
        raise ApiError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
    return record


async def _call(request: Request, caller: Caller, method, *args):
    try:
        return await bulk(request, caller.tenant, method, *args)
    except BatchRefused as refused:
        raise ApiError(refused.status, str(refused), param=refused.param, code=refused.code) from None


@router.post("")
async def create_batch(
    body: BatchCreate, request: Request, caller: Auth, idempotency_key: Annotated[str | None, Header()] = None,
) -> dict:
    check_idempotency_key(idempotency_key)
    record = await _call(request, caller, _store(request).create, body, idempotency_key, caller)
    request.app.state.metrics.batches_created.inc()
    return record.public()


@router.get("")
async def list_batches(
    request: Request, caller: Auth, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None,
) -> dict:
    records, has_more = await _call(request, caller, _store(request).list, limit, after, caller)
    data = [record.public() for record in records]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


@router.get("/{batch_id}")
async def get_batch(batch_id: str, request: Request, caller: Auth) -> dict:
    _found(await _call(request, caller, _store(request).get, batch_id, caller), batch_id)
    return _found(await _call(request, caller, _store(request).advance, batch_id), batch_id).public()


@router.get("/{batch_id}/refused")
async def refused_lines(batch_id: str, request: Request, caller: Auth) -> dict:
    """pagedq's extension: the input lines refused so far, as error-file lines (the error file
    itself is written when the batch ends)."""
    _found(await _call(request, caller, _store(request).get, batch_id, caller), batch_id)
    return {"object": "list", "data": await _call(request, caller, _store(request).refused, batch_id)}


@router.post("/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, caller: Auth) -> dict:
    _found(await _call(request, caller, _store(request).get, batch_id, caller), batch_id)
    return _found(await _call(request, caller, _store(request).request_cancel, batch_id), batch_id).public()
