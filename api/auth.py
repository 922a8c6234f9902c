"""Optional bearer-token auth: with `PAGEDQ_API_KEYS` set, every job endpoint needs one of the keys."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.errors import ApiError

# Declares the bearer scheme in the OpenAPI schema (so /docs has "Authorize"); the header is
# checked below, with this api's own error bodies.
_bearer = HTTPBearer(auto_error=False, description="One of PAGEDQ_API_KEYS (when set).")


def authenticate(request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]) -> str:
    """FastAPI dependency: the caller's key ("" when auth is off). Keys are never logged."""
    keys = request.app.state.settings.api_keys
    if not keys:
        return ""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", {"WWW-Authenticate": "Bearer"})
    # Compare against every key in constant time so timing does not reveal a prefix match.
    matches = [hmac.compare_digest(token.encode(), key.get_secret_value().encode()) for key in keys]
    if not any(matches):
        raise ApiError(401, "invalid API key", {"WWW-Authenticate": "Bearer"})
    return token
