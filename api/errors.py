"""Every api error is JSON `{"error": <kind>, "message": <what went wrong>}` (protocol.ErrorResponse).

Redis unreachable (down, restarting, loading its AOF) is the one failure a client can
wait out: 503 with Retry-After, never a 500.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException

log = logging.getLogger("pagedq.api")
# Seconds a client is asked to wait when Redis is unreachable.
REDIS_RETRY_AFTER_S = 2


class ApiError(HTTPException):
    """An HTTPException whose message reaches the client as given."""

    def __init__(self, status_code: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(status_code=status_code, detail=message, headers=headers)


def error_response(status_code: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = HTTPStatus(status_code).phrase.lower().replace(" ", "_")
    return JSONResponse({"error": kind, "message": message}, status_code=status_code, headers=headers)


def redis_unavailable(exc: Exception) -> JSONResponse:
    return error_response(
        503, f"the job store (Redis) is unreachable: {exc}; retry later", {"Retry-After": str(REDIS_RETRY_AFTER_S)}
    )


def describe_validation_errors(errors: list[dict]) -> str:
    parts = []
    for error in errors:
        # Drop FastAPI's leading "body" so the field reads as the client spelled it.
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        field = ".".join(location)
        parts.append(f"{field}: {error['msg']}" if field else error["msg"])
    return "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if any(error.get("type") == "json_invalid" for error in errors):
            return error_response(400, "malformed JSON body: " + describe_validation_errors(errors))
        return error_response(422, describe_validation_errors(errors))

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def _redis_unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.warning("Redis unreachable on %s %s: %s", request.method, request.url.path, exc)
        return redis_unavailable(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal error; see the api log")
