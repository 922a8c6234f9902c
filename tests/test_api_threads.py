"""Batch and file work (a batch's fan-out, uploads, the supervisor, the retention sweep) runs
in threads of its own: however much of it is waiting, the threads interactive requests use
stay free. (Four batch creates over large files held all four of them for ~12 s, and every
other tenant's chat, templated /generate and /ready waited.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import anyio

from api.threads import BLOCKING_THREADS, BULK_THREADS, blocking, blocking_limiter, bulk, bulk_limiter


def test_bulk_work_never_takes_the_threads_interactive_requests_use():
    release = threading.Event()
    state = SimpleNamespace()
    request = SimpleNamespace(app=SimpleNamespace(state=state))

    async def main() -> None:
        state.blocking, state.bulk = blocking_limiter(), bulk_limiter()
        async with anyio.create_task_group() as tasks:
            try:
                for _ in range(BLOCKING_THREADS + BULK_THREADS):  # more bulk work than there are threads
                    tasks.start_soon(bulk, request, release.wait)
                await anyio.wait_all_tasks_blocked()
                assert state.bulk.borrowed_tokens == BULK_THREADS
                with anyio.fail_after(10):
                    assert await blocking(request, lambda: "answered") == "answered"
            finally:
                release.set()

    anyio.run(main)
