"""Async reads of jobs' Redis streams: Server-Sent Events of text deltas, and long-poll waits.

A job's stream is written by whichever worker runs it, so any api replica can relay it,
and an SSE client resumes with Last-Event-ID (a stream entry id). A job can end without
an "end" entry (a worker died, RQ failed it, a plain `rq worker` ran it), so every quiet
`poll_s` the job's status is checked too.

One `StreamHub` per api process follows every stream its clients wait on with a single
blocking XREAD: an XREAD per client would cost a Redis round trip per token per client,
which at a few thousand tokens a second costs the api more CPU than the engine's steps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.job import Job

from pagedq.redis_schema import TERMINAL, Entry, Event, JobState, api_wake_key, is_end, job_state, read_events, stream_key

STREAM_ID_PATTERN = r"^\d+-\d+$"
log = logging.getLogger("pagedq.api")

def _sse(event: str, data: dict, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {event}\ndata: {json.dumps(data)}\n\n"


def _entry_id(text: str) -> tuple[int, int]:
    milliseconds, _, sequence = text.partition("-")
    return int(milliseconds), int(sequence)


@dataclass(eq=False)
class _Follower:
    cursor: str
    # Batches of new entries, or the exception that stopped the hub.
    batches: asyncio.Queue[list[Entry] | Exception] = field(default_factory=asyncio.Queue)


class StreamHub:
    def __init__(self, connection: AsyncRedis, block_s: float = 1.0):
        self.connection = connection
        self.block_ms = int(block_s * 1000)
        # XADDed to when a follower joins, so the blocked XREAD returns and takes it in.
        self._wake_key = api_wake_key(uuid.uuid4().hex)
        self._followers: dict[str, set[_Follower]] = {}
        self._task: asyncio.Task | None = None

    @asynccontextmanager
    async def follow(self, seq_id: str, cursor: str) -> AsyncIterator[asyncio.Queue[list[Entry] | Exception]]:
        """A queue of the stream's entries after `cursor`, in batches, while the context lasts."""
        key = stream_key(seq_id)
        follower = _Follower(cursor)
        self._followers.setdefault(key, set()).add(follower)
        try:
            if self._task is None or self._task.done():
                self._task = asyncio.create_task(self._run())
            else:
                await self._wake()
            yield follower.batches
        finally:
            followers = self._followers.get(key, set())
            followers.discard(follower)
            if not followers:
                self._followers.pop(key, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _wake(self) -> None:
        async with self.connection.pipeline(transaction=False) as pipeline:
            pipeline.xadd(self._wake_key, {"w": "1"}, maxlen=1)
            pipeline.expire(self._wake_key, 60)
            await pipeline.execute()

    async def _run(self) -> None:
        try:
            while self._followers:
                cursors = {
                    key: min((f.cursor for f in followers), key=_entry_id) for key, followers in self._followers.items()
                }
                reply = await self.connection.xread({**cursors, self._wake_key: "$"}, count=512, block=self.block_ms)
                for raw_key, raw_entries in reply or []:
                    entries = [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in raw_entries]
                    for follower in self._followers.get(raw_key.decode(), ()):
                        cursor = _entry_id(follower.cursor)
                        new = [entry for entry in entries if _entry_id(entry[0]) > cursor]
                        if new:
                            follower.cursor = new[-1][0]
                            follower.batches.put_nowait(new)
        except Exception as exc:  # Redis gone (or a bug): every follower learns of it, none hangs
            if not isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
                log.exception("stream hub failed")
            for followers in self._followers.values():
                for follower in followers:
                    follower.batches.put_nowait(exc)


class StreamReader:
    def __init__(self, connection: AsyncRedis, poll_s: float = 0.5):
        self.connection = connection
        self.poll_s = poll_s
        self.hub = StreamHub(connection)

    async def state(self, seq_id: str) -> JobState | None:
        return job_state(await self.connection.hget(Job.key_for(seq_id), "status"))

    async def _next(self, batches: asyncio.Queue, timeout_s: float) -> list[Entry] | None:
        """The next batch of entries; None after `timeout_s` without one."""
        try:
            async with asyncio.timeout(timeout_s):
                batch = await batches.get()
        except TimeoutError:
            return None
        if isinstance(batch, Exception):
            raise batch
        return batch

    async def events(self, seq_id: str, last_event_id: str | None) -> AsyncIterator[str]:
        """SSE frames: `delta` {index, text, num_tokens} (output `index`'s new text and its
        tokens generated so far; index > 0 only with n > 1), `reset`
        {attempt} (drop the text so far: a retry starts over), and a final `end` {status,
        finish_reason}. Redis going away mid-stream ends the response without `end`: the
        client reconnects with Last-Event-ID (and gets 503 until Redis is back)."""
        try:
            async for events in self.relay(seq_id, last_event_id or "0-0"):
                # One chunk per batch: fewer, larger writes when many tokens arrive together.
                yield "".join(_sse(kind, data, event_id) for kind, data, event_id in events)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("stream %s: Redis unreachable (%s); closing the stream", seq_id, exc)

    async def relay(self, seq_id: str, cursor: str = "0-0") -> AsyncIterator[list[Event]]:
        """The job's events after `cursor`, a batch at a time, until (and with) `end`."""
        async with self.hub.follow(seq_id, cursor) as batches:
            terminal_seen = False
            while True:
                batch = await self._next(batches, self.poll_s)
                if batch is None:
                    if terminal_seen:
                        # Ended without an "end" entry, and everything written has been relayed.
                        yield [("end", {"status": await self.state(seq_id), "finish_reason": None}, None)]
                        return
                    state = await self.state(seq_id)
                    terminal_seen = state is None or state in TERMINAL
                    continue
                events = read_events(batch)
                yield events
                if events and events[-1][0] == "end":
                    return

    async def wait_until_done(self, seq_id: str, timeout_s: float) -> None:
        """Return when the job is terminal or `timeout_s` has passed, waking on its "end" entry."""
        deadline = time.monotonic() + timeout_s
        last = await self.connection.xrevrange(stream_key(seq_id), count=1)
        cursor = last[0][0].decode() if last else "0-0"
        async with self.hub.follow(seq_id, cursor) as batches:
            while True:
                state = await self.state(seq_id)
                if state is None or state in TERMINAL:
                    return
                # Deltas come and go; only an "end" entry or a quiet poll_s needs a status check.
                while (remaining := deadline - time.monotonic()) > 0:
                    batch = await self._next(batches, min(self.poll_s, remaining))
                    if batch is None:
                        break
                    if any(is_end(fields) for _, fields in batch):
                        return
                else:
                    return

