"""ASGI middleware: at most `per_turn` requests start in one turn of the event loop.

A burst of requests that reach the api together is handled in one turn of the loop: each
handler runs until its first real wait (for a submission, its enqueue's round trip) and
nothing else runs in between, neither the replies of round trips already sent nor the
relays of open streams. Measured (`pagedq bench serve`, 512 requests at once, 2 cores):
the burst's first submission went to Redis alone and the other 511 waited 0.35 s, the time
to parse them all, for one shared enqueue, while the engine ran the first job alone for
hundreds of steps and every open stream stalled as long.

Here the requests beyond a turn's share wait, in arrival order, for later turns, so the
loop takes in what Redis answered after every `per_turn` request starts: a burst's
submissions reach the queue in groups as they are parsed (a worker starts the first while
the rest are parsed), and a burst never stalls the streams and long polls of others for
longer than `per_turn` starts take. A turn's share costs one future per waiting request
and one callback per turn, whatever the size of the burst.
"""

from __future__ import annotations

import asyncio
from collections import deque

from starlette.types import ASGIApp, Receive, Scope, Send


class RequestTurns:
    def __init__(self, app: ASGIApp, per_turn: int):
        """`per_turn` (Settings.api_requests_per_turn, 32): about 15 ms of request starts on a
        2-core host (a submission's start is ~0.45 ms of CPU), the longest a burst holds up
        everything else the loop has to do."""
        self.app = app
        self.per_turn = per_turn
        # Requests started since the current turn began.
        self._started = 0
        # Requests waiting for a later turn, oldest first.
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._next_turn_due = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._take_turn()
        await self.app(scope, receive, send)

    async def _take_turn(self) -> None:
        self._count_turns()
        if self._started < self.per_turn and not self._waiting:
            self._started += 1
            return
        ready = asyncio.get_running_loop().create_future()
        self._waiting.append(ready)
        await ready

    def _count_turns(self) -> None:
        """Have the next turn begin with _new_turn(): call_soon() runs it in the loop's next
        turn, before the tasks woken during this one."""
        if not self._next_turn_due:
            self._next_turn_due = True
            asyncio.get_running_loop().call_soon(self._new_turn)

    def _new_turn(self) -> None:
        self._next_turn_due = False
        self._started = 0
        while self._waiting and self._started < self.per_turn:
            ready = self._waiting.popleft()
            if not ready.done():  # its request was cancelled meanwhile
                ready.set_result(None)
                self._started += 1
        if self._started:
            self._count_turns()
