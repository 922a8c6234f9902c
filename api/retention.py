"""What the api prunes on a schedule, so that nothing in Redis lives forever unless asked.

Most keys expire by their own TTL: a job hash (with its prompt, partial result and, for
`Idempotency-Key` submits, the key: the seq_id is derived from it) `result_ttl_s` after it
finished, failed or was canceled (RQ's result and failure TTLs; the api's cancel script
sets it for cancels, which RQ leaves without one, and the worker for jobs canceled through
RQ itself: redis_schema.expire_canceled); its stream `stream_ttl_s` after
its last event; files and batch records `files_ttl_s` after they were made; the api's
wake-up streams within a minute; `pagedq:ended` is capped in length. A queued job keeps
no TTL: it waits for a worker however long that takes.

Left to this sweep, every `retention_sweep_interval_s` in every api process (idempotent,
and cheap: ranges of sorted sets by score): RQ's registries of canceled jobs, which RQ
never prunes, and the indexes of files and batches (global and per tenant), whose entries
outlive the records they name; each loses its entries older than its records live.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio
from fastapi import FastAPI
from redis import Redis
from rq.registry import CanceledJobRegistry

from pagedq.redis_connection import passing_redis_trouble
from pagedq.redis_schema import BATCHES_KEY, FILES_KEY, batch_queue_name, tenant_batches_key
from pagedq.settings import Settings

log = logging.getLogger("pagedq.api")


def sweep(connection: Redis, settings: Settings) -> int:
    """Prune what expired records left behind; how many entries went."""
    now = time.time()
    removed = 0
    for queue_name in (settings.queue_name, batch_queue_name(settings.queue_name)):
        registry_key = CanceledJobRegistry(queue_name, connection=connection).key
        # Scored by when the job was canceled; its hash expired result_ttl_s later.
        removed += connection.zremrangebyscore(registry_key, "-inf", f"({now - settings.result_ttl_s}")
    indexes = [FILES_KEY, BATCHES_KEY, *connection.scan_iter(match=tenant_batches_key("*"), count=1000)]
    for key in indexes:
        # Scored by creation time; the file or batch record expired files_ttl_s later.
        removed += connection.zremrangebyscore(key, "-inf", f"({now - settings.files_ttl_s}")
    return removed


async def keep_pruning(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    while True:
        try:
            removed = await anyio.to_thread.run_sync(sweep, app.state.redis, settings, limiter=app.state.bulk.limiter)
            if removed:
                log.info("retention: pruned %d index entries of expired jobs, files and batches", removed)
        except Exception as exc:
            if (trouble := passing_redis_trouble(exc)) is not None:
                log.warning("retention: Redis %s (%s); retrying", trouble, exc)
            else:
                log.exception("retention: the sweep failed; retrying")
        await asyncio.sleep(settings.retention_sweep_interval_s)
