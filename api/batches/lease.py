"""One api replica at a time works on a batch: a lease (a Redis key with our token and a
TTL) taken before and released after, renewed while long work goes on. A replica that dies
holding it only delays the batch by the lease's TTL."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from redis import Redis

from pagedq.redis_schema import batch_key

LEASE_S = 60
# Deletes a lease only if it is still ours. KEYS: the lease. ARGV: our token.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@contextmanager
def lease(connection: Redis, batch_id: str, wait_s: float) -> Iterator[bool]:
    """Yields whether the batch's lease was taken within `wait_s`."""
    key, token = batch_key(batch_id, "lease"), uuid.uuid4().hex
    deadline = time.monotonic() + wait_s
    while not (held := bool(connection.set(key, token, nx=True, ex=LEASE_S))) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield held
    finally:
        if held:
            connection.eval(_RELEASE, 1, key, token)


def renew(connection: Redis, batch_id: str) -> None:
    connection.expire(batch_key(batch_id, "lease"), LEASE_S)
