"""Queues submissions from the event loop, every submission waiting at that moment in one
Redis round trip (a group commit).

A burst of POSTs is what a serving benchmark, and a pipeline fanning out documents,
sends. Through the api's threads each submission paid a thread hop and a round trip of
its own, the GIL going back and forth between the loop and the thread on every reply:
about 1 ms of the api's CPU each, which made the burst's last requests wait for the first
ones' bookkeeping (a TTFT of seconds). Here a submission is built on the loop
(JobStore.prepare, ~0.2 ms) and joins the next pipeline: while one pipeline is out, what
arrives waits for the next, so under load many share a round trip and alone one waits for
nothing. Each submission still runs its own ENQUEUE_SCRIPT call, atomic on its own (the
idempotency check, the queue-depth limit, the push), in arrival order.
"""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import ConnectionError as RedisConnectionError

from api.jobs import ENQUEUE_SCRIPT, PreparedJob


class Submitter:
    def __init__(self, connection: AsyncRedis):
        self.connection = connection
        self._waiting: list[tuple[PreparedJob, asyncio.Future[int]]] = []
        self._flush: asyncio.Task | None = None

    async def enqueue(self, prepared: PreparedJob) -> int:
        """ENQUEUE_SCRIPT's reply for `prepared` (JobStore.settle() says what it means); a
        Redis error raises here, for this submission alone where Redis refused only its call."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((prepared, future))
        if self._flush is None or self._flush.done():
            # A task of its own: a waiter that goes away (its client disconnected) does not
            # take the others' round trip with it.
            self._flush = asyncio.create_task(self._send_waiting())
        return await future

    async def _send_waiting(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            try:
                async with self.connection.pipeline(transaction=False) as pipeline:
                    for prepared, _ in batch:
                        # EVAL, not EVALSHA: a pipeline of EVALSHA asks Redis first whether it
                        # has the script (a second round trip), as it may have restarted.
                        pipeline.eval(ENQUEUE_SCRIPT, len(prepared.keys), *prepared.keys, *prepared.args)
                    replies = await pipeline.execute(raise_on_error=False)
            except Exception as exc:  # the round trip failed: every submission in it hears of it
                if isinstance(exc, (OSError, RuntimeError)):
                    # A connection torn down under it (Redis restarting): uvloop's closed
                    # transport raises RuntimeError, which redis-py does not wrap. Said as
                    # Redis being away (503, retry), as the sync client says it, not as a crash.
                    exc = RedisConnectionError(f"the round trip to Redis broke off: {exc!r}")
                replies = [exc] * len(batch)
            for (_, future), reply in zip(batch, replies):
                if future.done():  # its waiter was cancelled
                    continue
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(int(reply))
