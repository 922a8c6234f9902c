"""Blocking work (RQ's sync Redis calls, the tokenizer) runs in threads, a few at once.

With one thread per request, a burst of submissions shares the GIL round-robin and is
answered all together at the end; a few threads answer it in arrival order, so the first
jobs start running while later ones are still arriving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
from fastapi import Request

BLOCKING_THREADS = 4
# Batches and files (a batch's fan-out reads its whole input file: 12-21 s for 40-90 MB, the
# supervisor advancing every batch, the retention sweep, uploads) have threads of their
# own: four batches created at once held every thread above, and every other tenant's
# chat, templated /generate, /ready and upload waited ~12 s. One tenant holds at most
# BULK_THREADS_PER_TENANT of them, so another's file and batch calls still find one.
BULK_THREADS = 4
BULK_THREADS_PER_TENANT = 2


def blocking_limiter() -> anyio.CapacityLimiter:
    return anyio.CapacityLimiter(BLOCKING_THREADS)


class BulkThreads:
    """The bulk threads, and each tenant's share of them."""

    def __init__(self) -> None:
        self.limiter = anyio.CapacityLimiter(BULK_THREADS)
        self._shares: dict[str, anyio.CapacityLimiter] = {}

    def share(self, tenant: str) -> anyio.CapacityLimiter:
        # Tenants are the configured keys' (api.auth): a bounded set.
        if tenant not in self._shares:
            self._shares[tenant] = anyio.CapacityLimiter(BULK_THREADS_PER_TENANT)
        return self._shares[tenant]


async def blocking(request: Request, function: Callable[..., Any], *args: Any) -> Any:
    """An interactive request's blocking work."""
    return await anyio.to_thread.run_sync(function, *args, limiter=request.app.state.blocking)


async def bulk(request: Request, tenant: str, function: Callable[..., Any], *args: Any) -> Any:
    """A tenant's batch or file work, in the bulk threads (at most its share of them)."""
    threads: BulkThreads = request.app.state.bulk
    async with threads.share(tenant):
        return await anyio.to_thread.run_sync(function, *args, limiter=threads.limiter)
