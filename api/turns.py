"""ASGI middleware: at most `per_turn` requests start in one turn of the event loop.

A burst of requests that reach the api together is handled in one turn of the loop: each
handler runs until its first real wait (for a submission, its enqueue's round trip) and
nothing else runs in between, neither the replies of round trips already sent nor the
relays of open streams. Measured (`pagedq bench serve`, 512 requests at once, 2 cores):
the burst's first submission went to Redis alone and the other 511 waited 0.35 s, the time
to parse them all, for one shared enqueue, while the engine ran the first job alone for
hundreds of steps and every open stream stalled as long.

Here the requests beyond a turn's share wait, in arrival order, for later turns, so the
loop takes in what Redis answered and relays open streams after every `per_turn` request
starts: a burst's submissions reach the queue in groups as they are parsed, and other
clients' streams keep moving. (A turn also runs whatever else became ready, such as the
handlers whose replies came in, so it is not bounded by `per_turn` alone: a bystander's stream
during a burst of 1,000 went silent for 1,131 ms (median of 5 rounds) before, 224 ms (median
of 17, 121-653) after; bench/results/2026-11-28-request-turns.md.) A
turn's share costs one future per waiting request and one callback per turn, whatever the
size of the burst.
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
        # The loop the count is kept on: an app run on another loop later (an embedding test
        # client's) starts afresh, not stuck on a turn its closed loop never began.
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._take_turn()
        await self.app(scope, receive, send)

    async def _take_turn(self) -> None:
        self._count_turns()
        if self._started < self.per_turn and not self._waiting:
            self._started += 1
            return
        ready = self._loop.create_future()
        self._waiting.append(ready)
        await ready

    def _count_turns(self) -> None:
        """Have the loop's next turn begin the count again (_new_turn(), made ready now: it runs
        in that turn, ahead of whatever is made ready after it)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._started, self._waiting, self._next_turn_due = loop, 0, deque(), False
        if not self._next_turn_due:
            self._next_turn_due = True
            loop.call_soon(self._new_turn)

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
