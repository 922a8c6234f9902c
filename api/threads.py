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


def blocking_limiter() -> anyio.CapacityLimiter:
    return anyio.CapacityLimiter(BLOCKING_THREADS)


async def blocking(request: Request, function: Callable[..., Any], *args: Any) -> Any:
    return await anyio.to_thread.run_sync(function, *args, limiter=request.app.state.blocking)
