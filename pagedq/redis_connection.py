"""The one place a `PAGEDQ_REDIS_URL` becomes Redis connections (api, worker, CLI, bench).

Two kinds of URL:

- `redis://[[user]:password@]host:port[/db]` (or `rediss://`, `unix://`): one Redis, as
  redis-py reads it.
- `redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db][?sentinel_password=...]`:
  Redis Sentinel. The hosts are sentinels; `service` is the name they monitor (their
  `sentinel monitor <service> ...`). Connections go to the service's current primary, asked
  of the sentinels whenever a connection is (re)made, so after a failover a retried command
  reaches the new primary; a connection still open to a demoted primary is dropped on its
  first READONLY answer (redis-py's SentinelManagedConnection). The user and password are
  the data nodes'; `sentinel_password` is the sentinels' own, if they have one.

Every pool can be bounded and blocking (`max_connections` + `timeout`): a caller beyond
the bound waits for a free connection rather than failing at once.

`passing_redis_trouble(exc)` is the one rule for which Redis errors pass on their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis import BlockingConnectionPool, ConnectionPool, Redis, __version__ as redis_py_version
from redis.asyncio import BlockingConnectionPool as AsyncBlockingConnectionPool
from redis.asyncio import ConnectionPool as AsyncConnectionPool
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.connection import Connection as AsyncConnection
from redis.asyncio.connection import SSLConnection as AsyncSSLConnection
from redis.asyncio.connection import UnixDomainSocketConnection as AsyncUnixConnection
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelConnectionPool
from redis.asyncio.sentinel import SentinelManagedConnection as AsyncSentinelManagedConnection
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.driver_info import DriverInfo
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import Sentinel, SentinelConnectionPool

# What each connection tells Redis it is (CLIENT SETINFO), its version read once: left to
# redis-py, every new connection reads the package's metadata from disk, ~0.5 ms of CPU,
# and a burst of requests opens dozens of connections in the api's pools.
_DRIVER_INFO = DriverInfo(lib_version=redis_py_version)


class _CPacked:
    """Packs commands in C (hiredis), as redis-py's blocking client does where hiredis is
    installed; its asyncio client packs them in Python, rejoining the growing buffer at
    every argument: 200 us for a submission's ENQUEUE_SCRIPT (49 arguments) against 24, and
    the stream hub's XREAD names every stream it follows."""

    _packer = HiredisRespSerializer()

    def pack_command(self, *args):
        return self._packer.pack(*args)


class _CPackedConnection(_CPacked, AsyncConnection):
    pass


class _CPackedSSLConnection(_CPacked, AsyncSSLConnection):
    pass


class _CPackedUnixConnection(_CPacked, AsyncUnixConnection):
    pass


class _CPackedSentinelConnection(_CPacked, AsyncSentinelManagedConnection):
    pass


# The asyncio pools' connection classes (as redis-py picks them by URL), packing in C.
_C_PACKED = {
    AsyncConnection: _CPackedConnection, AsyncSSLConnection: _CPackedSSLConnection,
    AsyncUnixConnection: _CPackedUnixConnection, AsyncSentinelManagedConnection: _CPackedSentinelConnection,
}

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's primary-following connections in a bounded pool that waits for a free one."""


class _AsyncBlockingSentinelPool(AsyncSentinelConnectionPool, AsyncBlockingConnectionPool):
    """The same, for redis.asyncio."""


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed `redis+sentinel://` URL."""

    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    options: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, url: str) -> SentinelTarget:
        parts = urlsplit(url)
        if parts.scheme != SENTINEL_SCHEME:
            raise ValueError(f"redis_url: not a {SENTINEL_SCHEME}:// URL: {url!r}")
        credentials, _, hosts = parts.netloc.rpartition("@")
        username, _, password = credentials.partition(":") if credentials else ("", "", "")
        sentinels = []
        for host in hosts.split(","):
            name, _, port = host.strip().rpartition(":") if ":" in host else (host.strip(), "", "")
            if not name:
                raise ValueError(f"redis_url: empty sentinel host in {url!r}")
            try:
                sentinels.append((name.strip("[]"), int(port) if port else DEFAULT_SENTINEL_PORT))
            except ValueError:
                raise ValueError(f"redis_url: bad sentinel port {port!r} in {url!r}") from None
        path = [segment for segment in parts.path.split("/") if segment]
        if not path or len(path) > 2:
            raise ValueError(f"redis_url: expected {SENTINEL_SCHEME}://host:port[,host:port]/service[/db], got {url!r}")
        try:
            db = int(path[1]) if len(path) == 2 else 0
        except ValueError:
            raise ValueError(f"redis_url: the database must be a number, got {path[1]!r}") from None
        query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        return cls(
            sentinels=sentinels, service=unquote(path[0]), db=db,
            username=unquote(username) or None, password=unquote(password) or None,
            sentinel_password=query.pop("sentinel_password", None), options=query,
        )

    def _node_kwargs(self) -> dict[str, Any]:
        return {"db": self.db, "username": self.username, "password": self.password}

    def _sentinel_kwargs(self, timeouts: dict[str, float]) -> dict[str, Any]:
        return {"password": self.sentinel_password, **timeouts}


def is_sentinel_url(url: str) -> bool:
    return url.startswith(f"{SENTINEL_SCHEME}://")


def _timeouts(options: dict[str, Any]) -> dict[str, Any]:
    return {key: options[key] for key in ("socket_timeout", "socket_connect_timeout") if key in options}


@dataclass(frozen=True)
class _PoolKinds:
    """The pool classes of one redis-py flavour (blocking I/O or asyncio)."""

    pool: type
    blocking_pool: type
    sentinel: type
    sentinel_pool: type
    blocking_sentinel_pool: type


_SYNC = _PoolKinds(ConnectionPool, BlockingConnectionPool, Sentinel, SentinelConnectionPool, _BlockingSentinelPool)
_ASYNC = _PoolKinds(AsyncConnectionPool, AsyncBlockingConnectionPool, AsyncSentinel, AsyncSentinelConnectionPool,
                    _AsyncBlockingSentinelPool)


def _pool(kinds: _PoolKinds, url: str, max_connections: int | None, timeout: float | None, options: dict[str, Any]):
    options = {"driver_info": _DRIVER_INFO, **options}
    if not is_sentinel_url(url):
        if max_connections is None:
            return kinds.pool.from_url(url, **options)
        return kinds.blocking_pool.from_url(url, max_connections=max_connections, timeout=timeout, **options)
    target = SentinelTarget.parse(url)
    sentinel = kinds.sentinel(target.sentinels, sentinel_kwargs=target._sentinel_kwargs(_timeouts(options)))
    kwargs = {**target._node_kwargs(), **options, "is_master": True}
    if max_connections is None:
        return kinds.sentinel_pool(target.service, sentinel, **kwargs)
    return kinds.blocking_sentinel_pool(target.service, sentinel, max_connections=max_connections, timeout=timeout, **kwargs)


def connection_pool(url: str, max_connections: int | None = None, timeout: float | None = None, **options: Any) -> ConnectionPool:
    """A pool for `url`; bounded and blocking when `max_connections` is given."""
    return _pool(_SYNC, url, max_connections, timeout, options)


def async_connection_pool(
    url: str, max_connections: int | None = None, timeout: float | None = None, **options: Any
) -> AsyncConnectionPool:
    """connection_pool() for redis.asyncio, its commands packed in C."""
    pool = _pool(_ASYNC, url, max_connections, timeout, options)
    pool.connection_class = _C_PACKED.get(pool.connection_class, pool.connection_class)
    return pool


def connect(url: str, **options: Any) -> Redis:
    """A client for `url` (a plain Redis or a Sentinel-managed primary)."""
    return Redis.from_pool(connection_pool(url, **options))


def connect_async(url: str, **options: Any) -> AsyncRedis:
    """connect() for redis.asyncio. A command or pipeline whose pooled connection Redis closed
    (it restarted, or failed over) is sent once more on a new connection: the blocking
    client's pool finds such a connection before handing it out, the asyncio one does not,
    and the api's first read after a restart answered 503 for it."""
    options.setdefault("retry", AsyncRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
    return AsyncRedis.from_pool(async_connection_pool(url, **options))


# Redis's refusals that pass once Redis recovers, by its error code: memory full under
# noeviction (OOM), a replica or a demoted primary (READONLY), still loading its data
# (LOADING), a script running too long (BUSY), failed snapshots refusing writes (MISCONF),
# too few replicas to accept writes (NOREPLICAS), a primary lost (MASTERDOWN), a cluster
# reconfiguring (TRYAGAIN, CLUSTERDOWN).
_PASSING_CODES = {
    "OOM": "is out of memory",
    "READONLY": "is read-only (a replica, or a primary demoted by a failover)",
    "LOADING": "is loading its data",
    "BUSY": "is busy running a script",
    "MISCONF": "refuses writes (it cannot save its snapshots)",
    "NOREPLICAS": "has too few replicas to accept writes",
    "MASTERDOWN": "has lost its primary",
    "TRYAGAIN": "is reconfiguring",
    "CLUSTERDOWN": "is reconfiguring",
}


# redis-py turns these codes into classes (and drops the code from the message).
_PASSING_KINDS = (
    (OutOfMemoryError, "OOM"), (ReadOnlyError, "READONLY"), (MasterDownError, "MASTERDOWN"),
    (TryAgainError, "TRYAGAIN"), (ClusterDownError, "CLUSTERDOWN"),
)


def passing_redis_trouble(exc: BaseException) -> str | None:
    """Why Redis cannot serve right now, when `exc` is trouble that passes without the
    caller changing anything (Redis unreachable, or refusing for a reason of its own: out
    of memory, read-only, loading, busy...): what the api answers with 503 and Retry-After
    and what a worker waits out, keeping its jobs. None for anything else (a bug, or the
    caller's fault)."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return "is unreachable" if not isinstance(exc, BusyLoadingError) else _PASSING_CODES["LOADING"]
    for kind, code in _PASSING_KINDS:
        if isinstance(exc, kind):
            return _PASSING_CODES[code]
    if isinstance(exc, ResponseError):
        # Codes redis-py has no class for stay in the message.
        message = str(exc)
        # A pipeline's error reads "Command # 3 (EVAL ...) of pipeline caused error: OOM ...".
        message = message.rpartition("caused error: ")[2] if "caused error: " in message else message
        return _PASSING_CODES.get(message.split(" ", 1)[0])
    return None
