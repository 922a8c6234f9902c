"""A job's stream carries its text exactly once, whatever happens to the worker's round
trips: a send Redis refused is sent again, and a send whose reply was lost (the connection
broke after Redis ran it, or before) is sent again split where it ended, the script
skipping what the stream holds. The chaos soak once saw a stream with a token twice: a
round trip that ran but whose reply never came back was sent again whole."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from rq.job import Job
from rq.serializers import JSONSerializer

from api.streaming import StreamHub
from pagedq.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedq.redis_schema import (
    DELTA_ARGS,
    UNFENCED,
    WRITTEN_KEY,
    PartialOutput,
    announced_entries,
    decode_entries,
    entry_fields,
    publish_end,
    publish_reset,
    read_events,
    read_partial,
    stream_key,
)
from tests.service_helpers import count_stream_reads
from worker.rq.publisher import Delta, ProgressPublisher

pytestmark = pytest.mark.slow

# Pieces of text a token may decode to, some of several bytes and some empty (a token
# that ends mid-character).
_PIECES = ["a", " 8", "é", "日本", "", "🙂", " the", "\n"]


def _job(redis: Redis, seq_id: str) -> Job:
    job = Job.create("builtins.print", connection=redis, id=seq_id, serializer=JSONSerializer)
    job.save()
    return job


class _Outputs:
    """A running request's cumulative output, grown token by token."""

    def __init__(self, seq_id: str, n: int, logprobs: bool):
        self.seq_id = seq_id
        self.completions = [CompletionOutput(i, "", [], None, [] if logprobs else None) for i in range(n)]

    def grow(self, rng: random.Random) -> RequestOutput:
        for completion in self.completions:
            for _ in range(rng.randint(0, 3)):
                token = rng.randrange(1000)
                completion.token_ids.append(token)
                completion.text += rng.choice(_PIECES)
                if completion.logprobs is not None:
                    completion.logprobs.append({token: Logprob(-rng.random(), 1)})
        return self.output()

    def output(self, finished: bool = False) -> RequestOutput:
        copies = [CompletionOutput(c.index, c.text, list(c.token_ids), None,
                                   None if c.logprobs is None else list(c.logprobs)) for c in self.completions]
        return RequestOutput(self.seq_id, "p", [1], copies, finished, RequestMetrics(time.time()))


def _send(publisher: ProgressPublisher, redis: Redis, outcome: str) -> None:
    """One publish whose round trip ends as `outcome`: answered, refused (nothing written),
    or broken off after or before Redis ran it (the reply lost either way)."""
    pipeline = redis.pipeline(transaction=False)
    sending = publisher.publish(pipeline)
    if outcome in ("answered", "lost-after") and sending.queued:
        reply = pipeline.execute()[-1]
    if outcome == "answered":
        publisher.published(sending, reply if sending.queued else None)
    elif outcome == "refused":
        publisher.failed(sending)
    else:
        publisher.uncertain(sending)


def _entries(redis: Redis, seq_id: str) -> list:
    return decode_entries(redis.xrange(stream_key(seq_id)))


def _streamed(redis: Redis, seq_id: str) -> dict[int, tuple[str, list[int], list]]:
    """Per output: the text after the stream's last reset, each delta's token count, the logprobs."""
    outputs: dict[int, tuple[str, list[int], list]] = {}
    for event, data, _ in read_events(_entries(redis, seq_id)):
        if event == "reset":
            outputs = {}
        elif event == "delta":
            text, counts, logprobs = outputs.get(data["index"], ("", [], []))
            outputs[data["index"]] = (text + data["text"], counts + [data["num_tokens"]], logprobs + data.get("logprobs", []))
    return outputs


def _one_event_per_entry(redis: Redis, seq_id: str) -> list[int]:
    """Output 0's token counts, entry by entry (read_events would merge consecutive deltas)."""
    return [int(f[b"num_tokens"]) for _, f in redis.xrange(stream_key(seq_id)) if f.get(b"index") == b"0"]


@pytest.mark.parametrize("seed", range(12))
def test_a_stream_holds_each_token_once_whichever_round_trips_broke(redis, seed):
    rng = random.Random(seed)
    seq_id = f"publisher-{seed}"
    n, logprobs = rng.choice([1, 1, 2, 3]), rng.random() < 0.5
    job = _job(redis, seq_id)
    publisher = ProgressPublisher(redis, stream_ttl_s=600, progress_interval_s=0.0)
    publisher.track(job)
    request = _Outputs(seq_id, n, logprobs)
    outcomes = ["answered", "refused", "lost-after", "lost-before"]
    for _ in range(rng.randint(5, 25)):
        publisher.update(seq_id, request.grow(rng))
        _send(publisher, redis, rng.choice(outcomes))
    publisher.update(seq_id, request.output(finished=True))
    _send(publisher, redis, "answered")

    streamed = _streamed(redis, seq_id)
    for completion in request.completions:
        text, counts, logprobs_seen = streamed.get(completion.index, ("", [], []))
        assert text == completion.text
        assert counts == sorted(set(counts)) and (not counts or counts[-1] == len(completion.token_ids))
        if completion.logprobs is not None:
            assert [token for token, _ in logprobs_seen] == completion.token_ids
    counts = _one_event_per_entry(redis, seq_id)
    assert counts == sorted(set(counts)), "a delta of output 0 was written twice"
    # The partial result GET /result reads back from the stream: every output, each token once.
    partial = read_partial(_entries(redis, seq_id))
    for completion in request.completions:
        assert partial.output(completion.index) == PartialOutput(completion.text, completion.token_ids)
    assert partial.completion_tokens == sum(len(completion.token_ids) for completion in request.completions)
    assert (partial.first_token is not None) == bool(request.completions[0].token_ids)


def test_a_lost_reply_after_a_reset_does_not_count_the_earlier_attempts_text(redis):
    """Attempt 1 streamed five tokens and died; attempt 2's first send is lost before it
    ran: the check reads the stream back only to the reset, so attempt 2's text is whole."""
    seq_id = "publisher-reset"
    job = _job(redis, seq_id)
    first = ProgressPublisher(redis, stream_ttl_s=600, progress_interval_s=0.0)
    first.track(job)
    rng = random.Random(7)
    dead = _Outputs(seq_id, 1, False)
    for _ in range(5):
        dead.completions[0].token_ids.append(1)
        dead.completions[0].text += "x"
    first.update(seq_id, dead.output())
    _send(first, redis, "answered")

    with redis.pipeline(transaction=False) as pipeline:
        publish_reset(pipeline, seq_id, 2, 600)
        pipeline.execute()
    second = ProgressPublisher(redis, stream_ttl_s=600, progress_interval_s=0.0)
    second.track(job)
    rerun = _Outputs(seq_id, 1, False)
    rerun.completions[0].token_ids += [2, 3, 4]
    rerun.completions[0].text += "abc"
    second.update(seq_id, rerun.output())
    _send(second, redis, "lost-before")
    second.update(seq_id, rerun.grow(rng))
    _send(second, redis, "answered")
    assert _streamed(redis, seq_id)[0][0] == rerun.completions[0].text
    partial = read_partial(_entries(redis, seq_id))
    assert partial.outputs == {0: PartialOutput(rerun.completions[0].text, rerun.completions[0].token_ids)}


def test_a_job_nobody_streams_publishes_its_tokens_every_progress_interval(redis):
    """stream false (a polling client, a batch line): its deltas are batched to one per
    progress_interval_s, the first and the last at once, and still hold every token once."""
    seq_id = "publisher-unstreamed"
    job = _job(redis, seq_id)
    publisher = ProgressPublisher(redis, stream_ttl_s=600, progress_interval_s=3600.0)
    publisher.track(job, stream=False)
    request = _Outputs(seq_id, 1, False)
    rng = random.Random(3)
    for step in range(20):
        # The worker builds a job's output only when its delta is due: the first at once.
        assert publisher.due(seq_id) == (step == 0)
        request.completions[0].token_ids.append(rng.randrange(1000))
        request.completions[0].text += rng.choice(_PIECES)
        publisher.update(seq_id, request.output())
        _send(publisher, redis, "answered")
    publisher.update(seq_id, request.output(finished=True))
    _send(publisher, redis, "answered")
    assert _one_event_per_entry(redis, seq_id) == [1, 20]
    streamed = ProgressPublisher(redis, stream_ttl_s=600, progress_interval_s=3600.0)
    streamed.track(_job(redis, "publisher-streamed"))
    streamed.update("publisher-streamed", request.output())
    _send(streamed, redis, "answered")
    assert streamed.due("publisher-streamed")  # stream_interval_s 0: every round trip
    partial = read_partial(_entries(redis, seq_id))
    assert partial.outputs == {0: PartialOutput(request.completions[0].text, request.completions[0].token_ids)}


def test_every_write_to_a_stream_is_announced_with_the_streams_it_wrote(redis):
    """The api's hub reads only the streams announced in WRITTEN_KEY (between its reads of
    every stream): one entry per send naming each stream it wrote, not a job whose delta
    the fence refused; a reset and an end announce their stream too."""

    def announced_since(cursor: bytes) -> list[list[str]]:
        return [fields[b"keys"].decode().split() for _, fields in redis.xrange(WRITTEN_KEY, f"({cursor.decode()}", "+")]

    def last_id() -> bytes:
        last = redis.xrevrange(WRITTEN_KEY, count=1)
        return last[0][0] if last else b"0-0"

    publisher = ProgressPublisher(redis, stream_ttl_s=600, progress_interval_s=0.0)
    seq_ids = ["announce-a", "announce-b", "announce-not-ours"]
    for seq_id in seq_ids:
        # Owned by another execution (its job hash names none): nothing written, nothing announced.
        publisher.track(_job(redis, seq_id), fence="another:execution" if seq_id == "announce-not-ours" else UNFENCED)
        request = _Outputs(seq_id, 2, False)
        request.completions[0].token_ids.append(1)
        request.completions[1].token_ids.append(2)
        publisher.update(seq_id, request.output())
    before = last_id()
    pipeline = redis.pipeline(transaction=False)
    sending = publisher.publish(pipeline)
    assert publisher.published(sending, pipeline.execute()[-1]) == ["announce-not-ours"]
    assert [sorted(keys) for keys in announced_since(before)] == [[stream_key("announce-a"), stream_key("announce-b")]]
    assert redis.xlen(stream_key("announce-a")) == 2  # one delta per output, the stream named once
    # The step's announcement carries the entries as written, each after its stream's entry before.
    (_, fields), = redis.xrange(WRITTEN_KEY, f"({before.decode()}", "+")
    carried = announced_entries(fields)
    for seq_id in ("announce-a", "announce-b"):
        first, second = _entries(redis, seq_id)
        assert [(a.before, (a.entry_id, entry_fields(a.flat_fields))) for a in carried if a.key == stream_key(seq_id)] == [
            ("0-0", first), (first[0], second)]
    assert len(carried) == 4
    # A stream with entries already: the first delta of a send follows on from its last entry.
    request = _Outputs("announce-b", 2, False)
    request.completions[0].token_ids += [2, 3]
    publisher.update("announce-b", request.output())
    before = last_id()
    publisher.flush()
    (_, fields), = redis.xrange(WRITTEN_KEY, f"({before.decode()}", "+")
    b_entries = _entries(redis, "announce-b")
    assert [(a.key, a.before, (a.entry_id, entry_fields(a.flat_fields))) for a in announced_entries(fields)] == [
        (stream_key("announce-b"), b_entries[-2][0], b_entries[-1])]

    before = last_id()
    with redis.pipeline(transaction=False) as pipeline:
        publish_reset(pipeline, "announce-a", 2, 600)
        publish_end(pipeline, "announce-b", "finished", 600)
        pipeline.execute()
    assert announced_since(before) == [[stream_key("announce-a")], [stream_key("announce-b")]]


def test_the_hub_relays_a_steps_deltas_from_their_announcement_and_a_follower_behind_misses_nothing(redis_server, redis):
    """The api's hub takes the deltas of an engine step from their announcement: a running
    job's stream is never read, however many steps it publishes (the read of every stream
    each block_s aside). A follower whose cursor is behind an announced entry (it resumed
    from an earlier one) gets what lies between from its stream, then the rest, each entry once."""
    publisher = ProgressPublisher(redis, stream_ttl_s=600, progress_interval_s=0.0)
    seq_id = "hub-announced"
    publisher.track(_job(redis, seq_id))
    request = _Outputs(seq_id, 1, False)
    rng = random.Random(7)

    def step() -> None:
        request.completions[0].token_ids.append(rng.randrange(1000))
        request.completions[0].text += rng.choice(["x", "y", " z"])
        publisher.update(seq_id, request.output())
        publisher.flush()

    async def run() -> tuple[list[str], list[str], list[int]]:
        connection = AsyncRedis.from_url(redis_server.url)
        hub = StreamHub(connection, block_s=30)
        streams_read = count_stream_reads(connection)
        try:
            step()
            first_id = _entries(redis, seq_id)[0][0]
            async with hub.follow(seq_id, "0-0") as ahead:
                texts = [fields["text"] for _, fields in await asyncio.wait_for(ahead.get(), 10)]
                await asyncio.sleep(0.2)  # the hub is blocked on the announcements
                streams_read.clear()
                for _ in range(10):
                    step()
                    texts += [fields["text"] for _, fields in await asyncio.wait_for(ahead.get(), 10)]
                reads_while_streaming = list(streams_read)
                step()
                step()
                # Resumed from the first entry, behind every announcement to come: the next one
                # makes the hub read its stream from there.
                async with hub.follow(seq_id, first_id) as behind:
                    await asyncio.sleep(0.2)
                    step()
                    resumed: list[str] = []
                    while len(resumed) < 13:
                        resumed += [fields["text"] for _, fields in await asyncio.wait_for(behind.get(), 10)]
                    await asyncio.sleep(0.2)
                    assert behind.empty()
            return texts, resumed, reads_while_streaming
        finally:
            await hub.close()
            await connection.aclose()

    texts, resumed, reads_while_streaming = asyncio.run(run())
    written = [fields["text"] for _, fields in _entries(redis, seq_id)]
    assert texts == written[:11]
    assert resumed == written[1:]
    assert reads_while_streaming and not any(reads_while_streaming), reads_while_streaming


def test_a_delta_sends_what_the_script_reads():
    assert len(Delta(0, "text", 3, True, "", False, "1,2,3", 1.0).args()) == DELTA_ARGS
