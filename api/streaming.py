"""Async reads of a job's Redis stream: Server-Sent Events of text deltas, and long-poll waits.

The stream is written by whichever worker runs the job, so any api replica can relay it,
and an SSE client resumes with Last-Event-ID (a stream entry id). A job can end without
an "end" entry (a worker died, RQ failed it, a plain `rq worker` ran it), so every quiet
`poll_s` the job's status is checked too.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from redis.asyncio import Redis as AsyncRedis
from rq.job import Job

from api.jobs import TERMINAL, job_state
from pagedq.protocol import EVENT_DELTA, EVENT_END, EVENT_RESET, JobState, stream_key

STREAM_ID_PATTERN = r"^\d+-\d+$"


def _sse(event: str, data: dict, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {event}\ndata: {json.dumps(data)}\n\n"


def _fields(raw: dict) -> dict[str, str]:
    return {key.decode(): value.decode() for key, value in raw.items()}


class StreamReader:
    def __init__(self, connection: AsyncRedis, poll_s: float = 0.5):
        self.connection = connection
        self.poll_s = poll_s

    async def state(self, seq_id: str) -> JobState | None:
        return job_state(await self.connection.hget(Job.key_for(seq_id), "status"))

    async def _read(self, seq_id: str, cursor: str, block_s: float | None) -> list[tuple[str, dict[str, str]]]:
        block = None if block_s is None else max(1, int(block_s * 1000))
        reply = await self.connection.xread({stream_key(seq_id): cursor}, count=512, block=block)
        if not reply:
            return []
        return [(entry_id.decode(), _fields(fields)) for entry_id, fields in reply[0][1]]

    async def events(self, seq_id: str, last_event_id: str | None) -> AsyncIterator[str]:
        """SSE frames: `delta` {text}, `reset` {attempt} (drop text so far: a retry starts over),
        and a final `end` {status, finish_reason}."""
        cursor = last_event_id or "0-0"
        status_seen_terminal = False
        while True:
            entries = await self._read(seq_id, cursor, None if status_seen_terminal else self.poll_s)
            for entry_id, fields in entries:
                cursor = entry_id
                kind = fields.get("type")
                if kind == EVENT_DELTA:
                    yield _sse("delta", {"text": fields.get("text", "")}, entry_id)
                elif kind == EVENT_RESET:
                    yield _sse("reset", {"attempt": int(fields.get("attempt", "0"))}, entry_id)
                elif kind == EVENT_END:
                    yield _sse("end", {"status": fields.get("status"), "finish_reason": fields.get("finish_reason") or None}, entry_id)
                    return
            if entries:
                continue
            if status_seen_terminal:
                # Ended without an "end" entry, and everything written has been relayed.
                yield _sse("end", {"status": await self.state(seq_id), "finish_reason": None})
                return
            state = await self.state(seq_id)
            status_seen_terminal = state is None or state in TERMINAL

    async def wait_until_done(self, seq_id: str, timeout_s: float) -> None:
        """Return when the job is terminal or `timeout_s` has passed, waking on its "end" entry."""
        deadline = time.monotonic() + timeout_s
        last = await self.connection.xrevrange(stream_key(seq_id), count=1)
        cursor = last[0][0].decode() if last else "0-0"
        while True:
            state = await self.state(seq_id)
            remaining = deadline - time.monotonic()
            if state is None or state in TERMINAL or remaining <= 0:
                return
            for entry_id, fields in await self._read(seq_id, cursor, min(self.poll_s, remaining)):
                cursor = entry_id
                if fields.get("type") == EVENT_END:
                    return
