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
# chat, templated /generate, /ready and upload waited ~12 s.
BULK_THREADS = 2


def blocking_limiter() -> anyio.CapacityLimiter:
    return anyio.CapacityLimiter(BLOCKING_THREADS)


def bulk_limiter() -> anyio.CapacityLimiter:
    return anyio.CapacityLimiter(BULK_THREADS)


async def blocking(request: Request, function: Callable[..., Any], *args: Any) -> Any:
    """An interactive request's blocking work."""
    return await anyio.to_thread.run_sync(function, *args, limiter=request.app.state.blocking)


async def bulk(request: Request, function: Callable[..., Any], *args: Any) -> Any:
    """Batch and file work, in its own threads (BULK_THREADS)."""
    return await anyio.to_thread.run_sync(function, *args, limiter=request.app.state.bulk)
