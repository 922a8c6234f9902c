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
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from pagedq.redis_connection import passing_redis_trouble
from pagedq.request_rules import IDEMPOTENCY_KEY, describe_error

log = logging.getLogger("pagedq.api")
# Seconds a client is asked to wait when Redis is unreachable.
REDIS_RETRY_AFTER_S = 2


OPENAI_PREFIX = "/v1/"
# vLLM's routes outside /v1 that answer errors in OpenAI's shape, as vLLM's do.
_VLLM_PATHS = ("/tokenize", "/detokenize")


def speaks_openai(path: str) -> bool:
    return path.startswith(OPENAI_PREFIX) or path in _VLLM_PATHS


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


# An Idempotency-Key reused with another request body: 422, on every route that takes the key,
# as the IETF's Idempotency-Key header draft (draft-ietf-httpapi-idempotency-key-header) answers it.
IDEMPOTENCY_CONFLICT_STATUS = 422
IDEMPOTENCY_CONFLICT_CODE = "idempotency_conflict"


def idempotency_conflict(message: str) -> ApiError:
    return ApiError(IDEMPOTENCY_CONFLICT_STATUS, message, code=IDEMPOTENCY_CONFLICT_CODE)


def check_idempotency_key(key: str | None) -> None:
    """400 for an Idempotency-Key header that request_rules.IDEMPOTENCY_KEY refuses."""
    if key is not None and not IDEMPOTENCY_KEY.fullmatch(key):
        raise ApiError(400, "Idempotency-Key: 1 to 255 printable ASCII characters, no spaces", param="Idempotency-Key")


def bad_request(exc: ValueError) -> ApiError:
    """400 for input a check refused; `param`: the field its message starts with. A pydantic
    ValidationError (a ValueError too) is described field by field, as a request body's own
    are (its text spans lines and links)."""
    if isinstance(exc, ValidationError):
        errors = exc.errors()
        return ApiError(400, describe_validation_errors(errors), param=first_field(errors))
    return ApiError(400, str(exc), param=named_field(str(exc)))


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
    if speaks_openai(path):
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


def _is_json(media_type: str) -> bool:
    return media_type == "application/json" or media_type.endswith("+json")


def _field(error: dict) -> str:
    # Drop FastAPI's leading "body" so the field reads as the client spelled it.
    return ".".join(str(part) for part in error.get("loc", ()) if part != "body")


def named_field(message: str) -> str | None:
    """The field an error message names first ("n: ..." names n), as OpenAI's `param`."""
    head, colon, _ = message.partition(":")
    return head if colon and head and " " not in head else None


def _describe(error: dict) -> str:
    return describe_error(_field(error), error["msg"])


def describe_validation_errors(errors: list[dict]) -> str:
    return "; ".join(_describe(error) for error in errors)


def first_field(errors: list[dict]) -> str | None:
    """The first invalid field's name, as the client spelled it (OpenAI's `param`): where a
    check of the whole body failed, the field its message names."""
    return next((field for error in errors if (field := _field(error) or named_field(_describe(error)))), None)


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
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if not _is_json(media_type) and any(tuple(error.get("loc", ())) == ("body",) for error in errors):
            # FastAPI reads a body as JSON only when it says it is: "Input should be a valid
            # dictionary" named neither the body nor its type.
            return error_response(415, f"the body must be JSON, sent with Content-Type: application/json "
                                  f"(it was {media_type or 'not given'})", path=path)
        if speaks_openai(path):
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
