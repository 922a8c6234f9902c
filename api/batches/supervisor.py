"""Every api process advances every active batch every `batch_poll_interval_s` (leases keep
replicas from doubling up), so a batch moves on whichever apis are up."""

from __future__ import annotations

import asyncio
import logging

import anyio
from fastapi import FastAPI

from api.batches.store import BatchStore
from pagedq.redis_connection import passing_redis_trouble
from pagedq.redis_schema import ACTIVE_BATCHES_KEY

log = logging.getLogger("pagedq.api")


async def supervise(app: FastAPI) -> None:
    """Advance the active batches forever; Redis outages are waited out."""
    store: BatchStore = app.state.batches
    interval = app.state.settings.batch_poll_interval_s

    def advance_all() -> None:
        for batch_id in store.connection.smembers(ACTIVE_BATCHES_KEY):
            try:
                store.advance(batch_id.decode())
            except Exception as exc:
                if passing_redis_trouble(exc) is not None:
                    raise
                # One batch's fault must not stop the others from advancing.
                log.exception("batch supervisor: advancing batch %s failed; retrying next round", batch_id.decode())

    while True:
        try:
            await anyio.to_thread.run_sync(advance_all, limiter=app.state.bulk.limiter)
        except Exception as exc:
            if (trouble := passing_redis_trouble(exc)) is not None:
                log.warning("batch supervisor: Redis %s (%s); retrying", trouble, exc)
            else:
                log.exception("batch supervisor: advancing batches failed; retrying")
        await asyncio.sleep(interval)
