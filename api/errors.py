"""Every api error is JSON `{"error": <kind>, "message": <what went wrong>}` (protocol.ErrorResponse),
except under /v1, where it is OpenAI's `{"error": {"message", "type", "param", "code"}}` and
a request that does not validate is a 400 (OpenAI clients expect that shape and status).

Redis unreachable (down, restarting, loading its AOF) or refusing for a reason that passes
(out of memory, read-only after a failover, busy: redis_connection.passing_redis_trouble)
is the one failure a client can wait out: 503 with Retry-After and the cause, never a 500,
and the connection stays open for the client's next request.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from pagedq.redis_connection import passing_redis_trouble

log = logging.getLogger("pagedq.api")
# Seconds a client is asked to wait when Redis is unreachable.
REDIS_RETRY_AFTER_S = 2


OPENAI_PREFIX = "/v1/"


class ApiError(HTTPException):
    """An HTTPException whose message reaches the client as given; `param` and `code` fill
    OpenAI's error fields on /v1."""

    def __init__(
        self, status_code: int, message: str, headers: dict[str, str] | None = None,
        param: str | None = None, code: str | None = None,
    ):
        super().__init__(status_code=status_code, detail=message, headers=headers)
        self.param = param
        self.code = code


def openai_error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    if status_code == 401:
        kind = "authentication_error"
    elif status_code == 429:
        kind = "rate_limit_error"
    elif status_code >= 500:
        kind = "server_error"
    else:
        kind = "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status_code: int, message: str, headers: dict[str, str] | None = None, *, path: str = "",
    param: str | None = None, code: str | None = None,
) -> JSONResponse:
    """The error in the shape its route speaks (`path`: the request's)."""
    if path.startswith(OPENAI_PREFIX):
        body = openai_error_body(status_code, message, param, code)
    else:
        body = {"error": HTTPStatus(status_code).phrase.lower().replace(" ", "_"), "message": message}
    return JSONResponse(body, status_code=status_code, headers=headers)


def redis_unavailable(exc: Exception, path: str = "") -> JSONResponse:
    trouble = passing_redis_trouble(exc) or "is unavailable"
    return error_response(
        503, f"the job store (Redis) {trouble}: {exc}; retry later", {"Retry-After": str(REDIS_RETRY_AFTER_S)},
        path=path, code="redis_unavailable",
    )


def _field(error: dict) -> str:
    # Drop FastAPI's leading "body" so the field reads as the client spelled it.
    return ".".join(str(part) for part in error.get("loc", ()) if part != "body")


def describe_validation_errors(errors: list[dict]) -> str:
    return "; ".join(f"{_field(error)}: {error['msg']}" if _field(error) else error["msg"] for error in errors)


def first_field(errors: list[dict]) -> str | None:
    """The first invalid field's name, as the client spelled it (OpenAI's `param`)."""
    return next((field for error in errors if (field := _field(error))), None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(
            exc.status_code, str(exc.detail), getattr(exc, "headers", None), path=request.url.path,
            param=getattr(exc, "param", None), code=getattr(exc, "code", None),
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        path = request.url.path
        if any(error.get("type") == "json_invalid" for error in errors):
            return error_response(400, "malformed JSON body: " + describe_validation_errors(errors), path=path)
        if path.startswith(OPENAI_PREFIX):
            return error_response(400, describe_validation_errors(errors), path=path, param=first_field(errors))
        return error_response(422, describe_validation_errors(errors))

    @app.exception_handler(RedisError)
    async def _redis_error(request: Request, exc: RedisError) -> JSONResponse:
        trouble = passing_redis_trouble(exc)
        if trouble is None:
            log.exception("Redis error on %s %s", request.method, request.url.path)
            return error_response(500, "internal error; see the api log", path=request.url.path)
        log.warning("Redis %s on %s %s: %s", trouble, request.method, request.url.path, exc)
        return redis_unavailable(exc, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal error; see the api log", path=request.url.path)
