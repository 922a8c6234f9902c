"""One Redis round trip for the short calls of every request waiting at that moment (a
group commit): submissions, the job reads of GET /result and of a stream's opening, the
status checks of waits.

A burst of requests is what a serving benchmark, and a pipeline fanning out documents,
sends. A command of its own per request took a pooled connection each: a burst of a
thousand opened the pool's every connection, and their connects, waiting behind the
burst's work on the event loop, ran past their timeout (a 503 saying Redis was
unreachable while it was idle). Through the api's threads each submission also paid a
thread hop and the GIL going back and forth (about 1 ms of the api's CPU each). Here a
call joins the next pipeline: while one pipeline is out, what arrives waits for the next,
so under load many share a round trip and one connection, and alone a call waits for
nothing. Each caller's commands keep their own replies, and a command Redis refuses fails
its caller alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError


class SharedRoundTrip:
    def __init__(self, connection: AsyncRedis):
        self.connection = connection
        self._waiting: list[tuple[Callable[[Pipeline], object], asyncio.Future[list]]] = []
        self._flush: asyncio.Task | None = None

    async def call(self, add: Callable[[Pipeline], object]) -> list:
        """The replies of the commands `add(pipeline)` queues, in order; the first error
        among them raises here (for this caller alone where Redis refused only its command)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((add, future))
        if self._flush is None or self._flush.done():
            # A task of its own: a caller that goes away (its client disconnected) does not
            # take the others' round trip with it.
            self._flush = asyncio.create_task(self._send_waiting())
        return await future

    async def _send_waiting(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            spans: list[slice] = []
            try:
                async with self.connection.pipeline(transaction=False) as pipeline:
                    for add, _ in batch:
                        start = len(pipeline.command_stack)
                        add(pipeline)
                        spans.append(slice(start, len(pipeline.command_stack)))
                    replies = await pipeline.execute(raise_on_error=False)
            except Exception as exc:  # the round trip failed: every caller in it hears of it
                if isinstance(exc, (OSError, RuntimeError)):
                    # A connection torn down under it (Redis restarting): uvloop's closed
                    # transport raises RuntimeError, which redis-py does not wrap. Said as
                    # Redis being away (503, retry), as the sync client says it, not as a crash.
                    exc = RedisConnectionError(f"the round trip to Redis broke off: {exc!r}")
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), span in zip(batch, spans):
                if future.done():  # its caller was cancelled
                    continue
                own = replies[span]
                error = next((reply for reply in own if isinstance(reply, Exception)), None)
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(own)
