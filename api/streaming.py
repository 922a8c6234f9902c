"""Async reads of jobs' Redis streams: Server-Sent Events of text deltas, and long-poll waits.

A job's stream is written by whichever worker runs it, so any api replica can relay it,
and an SSE client resumes with Last-Event-ID (a stream entry id). A job can end without
an "end" entry (a worker died, RQ failed it, a plain `rq worker` ran it), so every quiet
`poll_s` the job's status is checked too (a long-poll waiter's at intervals growing from
`poll_s` to `end_check_max_s`): by the hub, for every quiet stream and waiter at
once in one pipeline (a status read of its own per stream, and a timer per wait, were a
tenth of the api's CPU with a few hundred streams open).

One `StreamHub` per api process follows every stream its clients wait on with a single
blocking XREAD: an XREAD per client would cost a Redis round trip per token per client,
which at a few thousand tokens a second costs the api more CPU than the engine's steps.
It blocks on the announcements of stream writes (redis_schema.WRITTEN_KEY) alone: an
engine step's deltas come inside their announcement and go from there to the followers
they continue, so a running job's stream is not read at all; a stream announced without its
entries (a reset, an end, a cancel), one whose follower is behind what was announced, and a
newly followed one are read at once, from their followers' cursors. Every stream followed
is read each `block_s` too, so a write never announced is relayed all the same.
Long-poll waiters need only their jobs' ends, so the hub follows the one stream of every
job's end (redis_schema.ENDED_KEY) for them, not their jobs' tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import RedisError, ResponseError
from rq.job import Job

from api.auth import ANYONE, Caller
from api.jobs import read_finished_result
from api.shared_round_trip import SharedRoundTrip
from pagedq.protocol import SSE_ERROR_EVENT, STREAM_RETRY_AFTER_S
from pagedq.redis_connection import passing_redis_trouble
from pagedq.redis_schema import (
    ENDED_KEY,
    TERMINAL,
    WRITTEN_KEY,
    Entry,
    Event,
    JobState,
    announced_entries,
    api_wake_key,
    decode_entries,
    delta_logprobs,
    entry_fields,
    job_state,
    owner_of,
    read_events,
    stream_key,
)

_STREAM_ID = re.compile(r"^(\d{1,20})-(\d{1,20})$")
# Each half of a Redis stream entry id is an unsigned 64-bit integer.
_MAX_ID_PART = 2**64 - 1
log = logging.getLogger("pagedq.api")
# Entries one read takes of each stream at most.
_READ_COUNT = 512
# The longest interval between the status checks of a long-poll waiter's job: the checks
# only catch a job that ends without an end written (its end wakes the waiter at once), so
# they back off from quiet_s to this; every 0.5 s, a few hundred waiting polls' checks were
# ~7% of the api's CPU.
_END_CHECK_MAX_S = 2.0
# How often a stream tries again while Redis is in trouble.
_OUTAGE_RETRY_S = 0.5

def _native(kind: str, data: dict) -> dict:
    """An event as GET /stream documents it: `end` without the outputs' summary that the
    OpenAI streams end with (redis_schema.EVENT_END)."""
    return {"status": data["status"], "finish_reason": data["finish_reason"]} if kind == "end" else data


def _sse(event: str, data: dict, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {event}\ndata: {json.dumps(data)}\n\n"


def valid_stream_id(text: str) -> bool:
    """Whether Redis takes `text` as a stream entry id ("1700000000000-0")."""
    match = _STREAM_ID.match(text)
    return match is not None and all(int(part) <= _MAX_ID_PART for part in match.groups())


def _entry_id(text: str) -> tuple[int, int]:
    milliseconds, _, sequence = text.partition("-")
    return int(milliseconds), int(sequence)


def _earliest_cursor(followers: set[_Follower]) -> str:
    if len(followers) == 1:
        return next(iter(followers)).cursor
    return min((follower.cursor for follower in followers), key=_entry_id)


@dataclass(frozen=True)
class Quiet:
    """Nothing came on a followed stream for the hub's `quiet_s`: the job's state, read then."""

    state: JobState | None


@dataclass(eq=False)
class _Follower:
    seq_id: str
    cursor: str
    # Batches of new entries, Quiet ticks, or the exception that stopped the hub.
    batches: asyncio.Queue[list[Entry] | Quiet | Exception] = field(default_factory=asyncio.Queue)
    # When it was last given something (monotonic).
    fed_at: float = field(default_factory=time.monotonic)


class StreamHub:
    def __init__(self, connection: AsyncRedis, block_s: float = 1.0, quiet_s: float | None = None,
                 end_check_max_s: float = _END_CHECK_MAX_S):
        """`quiet_s`: a follower given nothing for this long gets a Quiet tick, and an end
        waiter's job whose status is terminal (or gone) is woken, checked after quiet_s, then
        at intervals doubling up to `end_check_max_s` (None: neither; the caller looks for itself)."""
        self.connection = connection
        self.block_s = block_s
        self.block_ms = int(block_s * 1000)
        self.quiet_s = quiet_s
        self.end_check_max_s = end_check_max_s if quiet_s is None else max(quiet_s, end_check_max_s)
        # XADDed to when a follower joins, so the blocked XREAD returns and takes it in. The
        # hub reads it from the last wake it saw, not from "$": a wake written while a read
        # was being sent (that read's streams built before the follower joined) would come
        # before "$" and be missed, and the newcomer wait a whole block.
        self._wake_key = api_wake_key(uuid.uuid4().hex)
        self._wake_cursor = "0-0"
        # A wake is out that the hub has not built a read since: followers joining meanwhile
        # are in the next read anyway (a burst of streams opening sends one wake, not one each).
        self._wake_pending = False
        self._followers: dict[str, set[_Follower]] = {}
        # Followed streams to read next: announced written (without their entries, or
        # ahead of a follower), or just followed.
        self._news: set[str] = set()
        # Where the hub is in WRITTEN_KEY, and when it next reads every stream it follows (monotonic).
        self._written_cursor = "0-0"
        self._sweep_at = 0.0
        # Long-poll waiters by job, and where the hub is in ENDED_KEY (None: not following it).
        self._enders: dict[str, set[asyncio.Event]] = {}
        # When each end waiter's job is next checked (monotonic), with quiet_s, and the
        # interval after that check (doubling from quiet_s to end_check_max_s).
        self._check_at: dict[str, float] = {}
        self._check_every: dict[str, float] = {}
        self._ended_cursor: str | None = None
        self._task: asyncio.Task | None = None

    @asynccontextmanager
    async def follow(self, seq_id: str, cursor: str) -> AsyncIterator[asyncio.Queue[list[Entry] | Quiet | Exception]]:
        """A queue of the stream's entries after `cursor`, in batches (and Quiet ticks, with
        quiet_s), while the context lasts."""
        key = stream_key(seq_id)
        follower = _Follower(seq_id, cursor)
        self._followers.setdefault(key, set()).add(follower)
        self._news.add(key)  # what the stream holds after `cursor` already
        try:
            await self._take_in()
            yield follower.batches
        finally:
            followers = self._followers.get(key, set())
            followers.discard(follower)
            if not followers:
                self._followers.pop(key, None)

    @asynccontextmanager
    async def until_end(self, seq_id: str) -> AsyncIterator[asyncio.Event]:
        """An event set once the job's end is written after this context was entered (or
        when the hub fails, or, with quiet_s, when a check finds the job ended or gone). A job
        can end without an end written (see the module's docstring): the caller checks the
        job's status too after entering (and, without quiet_s, now and then)."""
        ended = asyncio.Event()
        self._enders.setdefault(seq_id, set()).add(ended)
        if self.quiet_s is not None:
            self._check_at.setdefault(seq_id, time.monotonic() + self.quiet_s)
            self._check_every.setdefault(seq_id, self.quiet_s)
        try:
            if self._ended_cursor is None:
                last = await self.connection.xrevrange(ENDED_KEY, count=1)
                cursor = last[0][0].decode() if last else "0-0"
                # Two waiters starting at once: the earlier cursor, so neither misses an end.
                self._ended_cursor = min(filter(None, (cursor, self._ended_cursor)), key=_entry_id)
                await self._take_in()
            else:
                # A running hub's blocked XREAD already follows ENDED_KEY from before this waiter's entry.
                self._start()
            yield ended
        finally:
            enders = self._enders.get(seq_id, set())
            enders.discard(ended)
            if not enders:
                self._enders.pop(seq_id, None)
                self._check_at.pop(seq_id, None)
                self._check_every.pop(seq_id, None)

    def _start(self) -> bool:
        """Start the hub unless it is running; whether it was started."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
            return True
        return False

    async def _take_in(self) -> None:
        """Start the hub, or make its blocked XREAD return and read again with what was just
        added. A Redis that refuses the wake-up write (out of memory, read-only) delays the
        newcomer by one blocked read at most: the hub reads every follower's stream again
        each `block_s`."""
        if self._start() or self._wake_pending:
            return
        self._wake_pending = True
        try:
            await self._wake()
        except RedisError as exc:
            if passing_redis_trouble(exc) is None:
                raise
            self._wake_pending = False
            log.info("stream hub: Redis %s; a new follower waits for the next read", passing_redis_trouble(exc))

    async def _drop_refused(self, cursors: dict[str, str], exc: ResponseError) -> None:
        """Read each stream alone (without blocking) and fail the followers of those Redis refuses."""
        log.warning("stream hub: Redis refused a read (%s); finding the stream", exc)
        for key, cursor in cursors.items():
            try:
                await self.connection.xread({key: cursor}, count=1)
            except ResponseError as own:
                for follower in self._followers.pop(key, set()):
                    follower.batches.put_nowait(own)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _wake(self) -> None:
        async with self.connection.pipeline(transaction=False) as pipeline:
            pipeline.xadd(self._wake_key, {"w": "1"}, maxlen=1)
            pipeline.expire(self._wake_key, 60)
            await pipeline.execute()

    def _quiet_due(self) -> float:
        """When the first quiet tick or end waiter's check falls due (monotonic; inf: none)."""
        if self.quiet_s is None:
            return math.inf
        return min(
            [follower.fed_at + self.quiet_s for followers in self._followers.values() for follower in followers]
            + list(self._check_at.values()),
            default=math.inf,
        )

    def _block_ms(self, due: float) -> int:
        """How long the next read may block: until `due`, at most block_s."""
        if due == math.inf:
            return self.block_ms
        # At least 1 ms: 0 would block for ever.
        return max(1, min(self.block_ms, math.ceil((due - time.monotonic()) * 1000)))

    async def _check_quiet(self) -> None:
        """Read, in one pipeline, the status of every job whose stream has been quiet for
        quiet_s or whose end waiters are due a check; tell each quiet follower its job's
        state, and wake the waiters of jobs that ended (or are gone) without an "end"."""
        now = time.monotonic()
        quiet = [follower for followers in self._followers.values() for follower in followers
                 if now - follower.fed_at >= self.quiet_s]
        due = [seq_id for seq_id, at in self._check_at.items() if now >= at]
        if not quiet and not due:
            return
        seq_ids = list(dict.fromkeys([follower.seq_id for follower in quiet] + due))
        async with self.connection.pipeline(transaction=False) as pipeline:
            for seq_id in seq_ids:
                pipeline.hget(Job.key_for(seq_id), "status")
            states = dict(zip(seq_ids, map(job_state, await pipeline.execute())))
        for follower in quiet:
            follower.fed_at = now
            follower.batches.put_nowait(Quiet(states[follower.seq_id]))
        for seq_id in due:
            if seq_id in self._check_at:
                every = self._check_every[seq_id] = min(2 * self._check_every[seq_id], self.end_check_max_s)
                self._check_at[seq_id] = now + every
            if states[seq_id] is None or states[seq_id] in TERMINAL:
                for waiter in self._enders.get(seq_id, ()):
                    waiter.set()

    def _to_read(self) -> tuple[dict[str, str], bool]:
        """The followed streams to read now, with the cursor to read each from, and whether
        the read must return at once: those with news (see _news) and, each `block_s`, every
        one (a write never announced is read then)."""
        news, self._news = self._news, set()
        now = time.monotonic()
        if now >= self._sweep_at:
            news = set(self._followers)
            self._sweep_at = now + self.block_s
        news.intersection_update(self._followers)
        cursors = {key: _earliest_cursor(self._followers[key]) for key in news}
        return cursors, bool(news)

    def _take_announcements(self, raw_entries: list) -> None:
        """WRITTEN_KEY's new entries. An entry they carry goes to each follower of its stream
        whose cursor is at the entry before it (or between that and it: a resume from an id
        the stream never had); a follower further behind has entries to read first, so its
        stream is read at once (and the entry comes with them), as is a stream announced
        without its entries."""
        self._written_cursor = raw_entries[-1][0].decode()
        fed: dict[_Follower, list[Entry]] = {}
        for _, fields in raw_entries:
            carried = announced_entries(fields)
            if not carried:
                self._news.update(key for key in fields.get(b"keys", b"").decode().split() if key in self._followers)
            for key, before, entry_id, flat_fields in carried:
                followers = self._followers.get(key)
                if not followers:
                    continue  # another api process's client's
                entry = (entry_id, entry_fields(flat_fields))
                for follower in followers:
                    if follower.cursor != before:
                        cursor = _entry_id(follower.cursor)
                        if cursor < _entry_id(before):
                            self._news.add(key)
                            continue
                        if cursor >= _entry_id(entry_id):
                            continue  # relayed already, from a read of the stream
                    fed.setdefault(follower, []).append(entry)
                    follower.cursor = entry_id
        now = time.monotonic()
        for follower, entries in fed.items():
            follower.fed_at = now
            follower.batches.put_nowait(entries)

    async def _run(self) -> None:
        try:
            # Where the announcements stand before the first read (of every stream): a
            # write after that read is announced after this cursor.
            last = await self.connection.xrevrange(WRITTEN_KEY, count=1)
            self._written_cursor = last[0][0].decode() if last else "0-0"
            self._sweep_at = 0.0
            while self._followers or self._enders:
                cursors, at_once = self._to_read()
                control = {WRITTEN_KEY: self._written_cursor} if self._followers else {}
                if self._ended_cursor is not None:
                    control[ENDED_KEY] = self._ended_cursor
                control[self._wake_key] = self._wake_cursor
                self._wake_pending = False
                # Followers joining during the read fall due later than those before it.
                due = self._quiet_due()
                # Streams with news: at once. Else blocked until an announcement, an end, a
                # wake, or a quiet check or the next read of every stream falls due.
                block = None if at_once else self._block_ms(min(due, self._sweep_at))
                try:
                    reply = await self.connection.xread({**cursors, **control}, count=_READ_COUNT, block=block)
                except ResponseError as exc:
                    # Redis refused one stream's read: only that stream's followers hear of it.
                    await self._drop_refused(cursors, exc)
                    self._news.update(cursors)  # the others are read again at once
                    continue
                announcements: list = []
                for raw_key, raw_entries in reply or []:
                    key = raw_key.decode()
                    if key == self._wake_key:
                        self._wake_cursor = raw_entries[-1][0].decode()
                        continue
                    if key == WRITTEN_KEY:
                        announcements = raw_entries
                        continue
                    if key == ENDED_KEY:
                        self._ended_cursor = raw_entries[-1][0].decode()
                        for _, fields in raw_entries:
                            for waiter in self._enders.get(fields.get(b"seq_id", b"").decode(), ()):
                                waiter.set()
                        continue
                    if len(raw_entries) == _READ_COUNT:
                        self._news.add(key)  # more than one read's worth: the rest next
                    entries = decode_entries(raw_entries)
                    now = time.monotonic()
                    read_from = cursors[key]
                    for follower in self._followers.get(key, ()):
                        if follower.cursor == read_from:
                            new = entries  # read from its own cursor (the usual one follower a stream)
                        else:
                            cursor = _entry_id(follower.cursor)
                            if cursor < _entry_id(read_from):
                                # It joined behind this read (a resume from an earlier entry, a
                                # second viewer from the start): what lies between its cursor and
                                # the read's comes in the next read, from the earliest cursor.
                                # This read's entries now would carry it past that for good.
                                self._news.add(key)
                                continue
                            new = [entry for entry in entries if _entry_id(entry[0]) > cursor]
                        if new:
                            follower.cursor = new[-1][0]
                            follower.fed_at = now
                            follower.batches.put_nowait(new)
                # After the streams' entries, which may have taken followers past announced ones.
                if announcements:
                    self._take_announcements(announcements)
                if time.monotonic() >= due:
                    await self._check_quiet()
        except Exception as exc:  # Redis gone (or a bug): every follower learns of it, none hangs
            if passing_redis_trouble(exc) is None:
                log.exception("stream hub failed")
            for followers in self._followers.values():
                for follower in followers:
                    follower.batches.put_nowait(exc)
            # Waiters wake and meet the error in their own status check.
            for enders in self._enders.values():
                for waiter in enders:
                    waiter.set()
        finally:
            # Idle: the next waiter starts again from ENDED_KEY's last entry, not from here.
            if not self._enders:
                self._ended_cursor = None


class _Relayed:
    """How much of each output a relay from a stream's start has sent (characters, tokens)."""

    def __init__(self) -> None:
        self.sent: dict[int, tuple[int, int]] = {}

    async def completed(self, events: list[Event], read_result) -> list[Event]:
        """`events`, counted; when they end a finished job whose outputs have more tokens
        than were sent, with the rest of each output's text (and logprobs) from the result
        that `read_result()` reads, as one delta per output before the end."""
        for kind, data, _ in events:
            if kind == "delta":
                chars, _ = self.sent.get(data["index"], (0, 0))
                self.sent[data["index"]] = (chars + len(data["text"]), data["num_tokens"])
            elif kind == "reset":
                self.sent.clear()  # the client drops the text so far
        kind, end, _ = events[-1] if events else ("", {}, None)
        if kind != "end" or end.get("status") != "finished" or not any(
                tokens > self.sent.get(index, (0, 0))[1] for index, tokens, *_ in end.get("outputs", [])):
            return events
        result = await read_result()
        if result is None:
            return events
        rest: list[Event] = []
        for output in result.outputs:
            chars, tokens = self.sent.get(output.index, (0, 0))
            if len(output.token_ids) > tokens:
                data = {"index": output.index, "text": output.text[chars:], "num_tokens": len(output.token_ids)}
                if output.logprobs is not None:
                    data["logprobs"] = delta_logprobs(output.token_ids[tokens:], output.logprobs[tokens:])
                self.sent[output.index] = (len(output.text), len(output.token_ids))
                rest.append(("delta", data, None))
        return [*events[:-1], *rest, events[-1]]


class StreamReader:
    def __init__(self, connection: AsyncRedis, round_trip: SharedRoundTrip, poll_s: float = 0.5,
                 outage_grace_s: float = 30.0, end_check_max_s: float = _END_CHECK_MAX_S):
        """`connection`: the hub's (its blocking XREAD); `round_trip`: the job status reads'."""
        self.connection = connection
        self.round_trip = round_trip
        # How long a stream waits out Redis trouble before it gives up (see relay()).
        self.outage_grace_s = outage_grace_s
        self.hub = StreamHub(connection, quiet_s=poll_s, end_check_max_s=end_check_max_s)

    async def visible_state(self, seq_id: str, caller: Caller) -> JobState | None:
        """The job's state, None when there is no such job or it is another tenant's."""
        ((status, meta),) = await self.round_trip.call(lambda pipeline: pipeline.hmget(Job.key_for(seq_id), "status", "meta"))
        return job_state(status) if status is not None and caller.owns(owner_of(meta)) else None

    async def state(self, seq_id: str) -> JobState | None:
        (status,) = await self.round_trip.call(lambda pipeline: pipeline.hget(Job.key_for(seq_id), "status"))
        return job_state(status)

    @staticmethod
    async def _next(batches: asyncio.Queue) -> tuple[list[Entry], Quiet | None]:
        """Every entry queued (waiting for the first batch or Quiet tick), and the last Quiet
        tick among them. A reader that fell behind takes all its batches at once (read_events
        then merges their deltas into one event: fewer, larger writes when the api is the
        bottleneck)."""
        item = await batches.get()
        entries: list[Entry] = []
        quiet = None
        while True:
            if isinstance(item, Exception):
                raise item
            if isinstance(item, Quiet):
                quiet = item
            else:
                entries += item
            if batches.empty():
                return entries, quiet
            item = batches.get_nowait()

    async def events(self, seq_id: str, last_event_id: str | None) -> AsyncIterator[str]:
        """SSE frames: `delta` {index, text, num_tokens} (output `index`'s new text and its
        tokens generated so far; index > 0 only with n > 1), `reset`
        {attempt} (drop the text so far: a retry starts over), and a final `end` {status,
        finish_reason}. When Redis cannot serve the stream any more (unreachable, or
        refusing this stream's read) the last frame is `error` {message, retry_after_s}:
        the client reconnects with Last-Event-ID (and gets 503 until Redis is back)."""
        try:
            async for events in self.relay(seq_id, last_event_id or "0-0"):
                # One chunk per batch: fewer, larger writes when many tokens arrive together.
                yield "".join(_sse(kind, _native(kind, data), event_id) for kind, data, event_id in events)
        except RedisError as exc:
            trouble = passing_redis_trouble(exc)
            why = f"Redis {trouble}" if trouble is not None else f"Redis refused this stream's read ({exc})"
            log.warning("stream %s: %s; closing the stream", seq_id, why)
            yield _sse(SSE_ERROR_EVENT, {"message": f"the stream cannot go on: {why}; reconnect with Last-Event-ID",
                                     "retry_after_s": STREAM_RETRY_AFTER_S})

    async def relay(self, seq_id: str, cursor: str = "0-0") -> AsyncIterator[list[Event]]:
        """The job's events after `cursor`, a batch at a time, until (and with) `end`.
        Redis trouble that passes (a restart, a failover, memory full) is waited out for up
        to `outage_grace_s`, following on from the last event relayed, so a stream outlives
        a Redis blip; a longer outage is raised. Followed from its start, a finished job's
        stream has all its text: what its stream lacks (a job nobody streamed loses its
        deltas when it finishes, its result holding them) comes from its result, before `end`."""
        trouble_since: float | None = None
        relayed = _Relayed() if cursor == "0-0" else None
        while True:
            try:
                async for events in self._relay_from(seq_id, cursor):
                    trouble_since = None
                    cursor = next((event_id for _, _, event_id in reversed(events) if event_id), cursor)
                    if relayed is not None:
                        events = await relayed.completed(events, lambda: read_finished_result(self.round_trip, seq_id))
                    yield events
                return
            except RedisError as exc:
                trouble = passing_redis_trouble(exc)
                now = time.monotonic()
                trouble_since = trouble_since if trouble_since is not None else now
                if trouble is None or now - trouble_since >= self.outage_grace_s:
                    raise
                log.info("stream %s: Redis %s; following on in a moment", seq_id, trouble)
                await asyncio.sleep(_OUTAGE_RETRY_S)

    async def _relay_from(self, seq_id: str, cursor: str) -> AsyncIterator[list[Event]]:
        async with self.hub.follow(seq_id, cursor) as batches:
            terminal_seen = False
            while True:
                batch, quiet = await self._next(batches)
                if not batch:
                    if terminal_seen:
                        # Everything after the cursor has been relayed, and the job has ended:
                        # its stream's own "end" when the client resumed past it (with its
                        # finish_reason), else one made of the state (it ended without one).
                        last = decode_entries(await self.connection.xrevrange(stream_key(seq_id), count=1))
                        ended = read_events(last)
                        if ended and ended[-1][0] == "end":
                            yield ended[-1:]
                        else:
                            yield [("end", {"status": quiet.state, "finish_reason": None}, None)]
                        return
                    terminal_seen = quiet.state is None or quiet.state in TERMINAL
                    continue
                events = read_events(batch)
                yield events
                if events and events[-1][0] == "end":
                    return

    async def wait_until_done(self, seq_id: str, timeout_s: float, caller: Caller = ANYONE) -> None:
        """Return when the job is terminal or `timeout_s` has passed: woken by its end, or
        by the hub's status checks (after `poll_s`, then at intervals doubling up to
        `end_check_max_s`) for a job that ends without one. At once for a job that is not
        there or not `caller`'s (its status, read once after the wait is set up, says which:
        an end written before then is seen by that read, one after it wakes the wait)."""
        deadline = time.monotonic() + timeout_s
        async with self.hub.until_end(seq_id) as ended:
            state = await self.visible_state(seq_id, caller)
            if state is None or state in TERMINAL:
                return
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                    await ended.wait()
            except TimeoutError:
                return
