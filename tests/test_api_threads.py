"""Batch and file work (a batch's fan-out, uploads, the supervisor, the retention sweep) runs
in threads of its own, a tenant holding at most its share of them: however much of it one
tenant has waiting, the threads interactive requests use stay free, and another tenant's
file and batch calls still find a thread. (Four batch creates over large files held every
thread for ~12-22 s, and every other tenant's chat, /ready, uploads and listings waited.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import anyio

from api.threads import BULK_THREADS_PER_TENANT, BulkThreads, blocking, blocking_limiter, bulk


def test_one_tenants_bulk_work_leaves_threads_for_interactive_requests_and_other_tenants():
    release = threading.Event()
    state = SimpleNamespace()
    request = SimpleNamespace(app=SimpleNamespace(state=state))

    async def main() -> None:
        state.blocking, state.bulk = blocking_limiter(), BulkThreads()
        async with anyio.create_task_group() as tasks:
            try:
                for _ in range(10):  # more of one tenant's bulk work than there are threads
                    tasks.start_soon(bulk, request, "busy", release.wait)
                await anyio.wait_all_tasks_blocked()
                assert state.bulk.limiter.borrowed_tokens == BULK_THREADS_PER_TENANT
                with anyio.fail_after(10):
                    assert await blocking(request, lambda: "answered") == "answered"
                    assert await bulk(request, "other", lambda: "listed") == "listed"
            finally:
                release.set()

    anyio.run(main)
