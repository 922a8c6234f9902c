"""Optional bearer-token auth and tenancy.

With keys configured (PAGEDQ_API_KEYS, PAGEDQ_TENANT_KEYS, PAGEDQ_ADMIN_API_KEYS) every
job, file and batch belongs to the tenant that created it: a key of its own, or a named
tenant whose keys share its work. Another tenant's ids answer 404, as ids that do not
exist (so an id's existence leaks nothing); an admin key sees and acts on everything.
Without keys everyone is one tenant.

Keys never reach Redis or a log: an owner is stored as the tenant's name, or for a key of
its own a hash of it; the access log has query strings cut (a key sent as `?api_key=` is
refused, and not written down) and any configured key that appears in a record anyway is
masked (`KeyRedactor`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from typing import Annotated

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.errors import ApiError
from pagedq.settings import Settings

# Declares the bearer scheme in the OpenAPI schema (so /docs has "Authorize"); the header is
# checked below, with this api's own error bodies.
_bearer = HTTPBearer(auto_error=False, description="One of PAGEDQ_API_KEYS (when set).")


@dataclass(frozen=True)
class Caller:
    # The owner recorded on what this caller creates.
    tenant: str
    # Sees and acts on every tenant's jobs, files and batches.
    admin: bool = False

    def owns(self, owner: str | None) -> bool:
        return self.admin or owner == self.tenant


# Auth off: one tenant that sees everything.
ANYONE = Caller(tenant="", admin=True)


class Keyring:
    """The configured keys, each mapped to the Caller it authenticates."""

    def __init__(self, settings: Settings):
        self._callers: list[tuple[bytes, Caller]] = []
        for key in settings.api_keys:
            secret = key.get_secret_value()
            self._callers.append((secret.encode(), Caller(f"key:{hashlib.sha256(secret.encode()).hexdigest()[:24]}")))
        for name, keys in settings.tenant_keys.items():
            self._callers += [(key.get_secret_value().encode(), Caller(f"tenant:{name}")) for key in keys]
        self._callers += [(key.get_secret_value().encode(), Caller("admin", admin=True)) for key in settings.admin_api_keys]
        self.probes_require_key = settings.probes_require_key

    @property
    def enabled(self) -> bool:
        return bool(self._callers)

    def secrets(self) -> list[str]:
        return [secret.decode() for secret, _ in self._callers]

    def caller(self, token: str) -> Caller | None:
        # Compared against every key in constant time, so timing reveals neither a prefix nor which key matched.
        found = None
        for secret, caller in self._callers:
            if hmac.compare_digest(token.encode(), secret):
                found = caller
        return found


async def authenticate(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)] = None
) -> Caller:
    """FastAPI dependency: who is calling (ANYONE when auth is off). A coroutine though it
    awaits nothing: FastAPI runs a plain function's dependency in its threadpool, a thread
    hop on every request that cost more of the api's CPU than the rest of a submission."""
    return _caller(request)


def _caller(request: Request) -> Caller:
    keyring: Keyring = request.app.state.keyring
    if not keyring.enabled:
        return ANYONE
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", {"WWW-Authenticate": "Bearer"})
    caller = keyring.caller(token)
    if caller is None:
        raise ApiError(401, "invalid API key", {"WWW-Authenticate": "Bearer"})
    return caller


async def authenticate_probe(request: Request) -> Caller:
    """FastAPI dependency of /metrics and /ready: a key only when configured so
    (PAGEDQ_PROBES_REQUIRE_KEY). Then their counts, which span every tenant, are an admin
    key's alone: a tenant key learns that the service is ready, nothing of the others'
    work. Without keys on probes, the probes answer everyone (an operator's network)."""
    if request.app.state.keyring.probes_require_key:
        return _caller(request)
    return ANYONE


class KeyRedactor(logging.Filter):
    """Keeps keys out of log records: the access log's paths lose their query strings, and
    any configured key left in a record's text is masked."""

    def __init__(self, secrets: list[str]):
        super().__init__()
        self.secrets = [secret for secret in secrets if secret]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            # (client, method, path with query, HTTP version, status)
            client, method, path, version, status = record.args
            record.args = (client, method, str(path).partition("?")[0], version, status)
        if self.secrets:
            message = record.getMessage()
            masked = message
            for secret in self.secrets:
                masked = masked.replace(secret, "[key]")
            if masked != message:
                record.msg, record.args = masked, ()
        return True


# One per process, so every app served by it (tests run several) has its keys masked.
_REDACTOR = KeyRedactor([])


def install_key_redactor(settings: Settings) -> None:
    """Filter the loggers the api writes through (uvicorn's and ours) for these settings' keys."""
    _REDACTOR.secrets = sorted(set(_REDACTOR.secrets) | set(Keyring(settings).secrets()), key=len, reverse=True)
    for name in ("uvicorn.access", "uvicorn.error", "pagedq.api"):
        logger = logging.getLogger(name)
        if _REDACTOR not in logger.filters:
            logger.addFilter(_REDACTOR)
