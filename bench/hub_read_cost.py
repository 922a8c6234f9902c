"""The api's stream hub's CPU per relayed write, against how many quiet streams it follows.

One busy stream gets WRITES deltas (each written and announced as the worker writes them:
the delta, then its stream named in redis_schema.WRITTEN_KEY, in one transaction), one at a time, each waited
for at the follower, while the hub also follows QUIET streams nobody writes to (queued
jobs' streams, clients waiting). Prints this process's CPU microseconds per relayed write
(the writer is another process). Run with PYTHONPATH=TREE to measure TREE's hub:

    PYTHONPATH=TREE .venv/bin/python bench/hub_read_cost.py [QUIET ...]
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

WRITES = 400


def _writer(url: str, go, done) -> None:
    from redis import Redis

    from pagedq import redis_schema

    # Absent from trees older than the announcements: their hub reads every stream anyway.
    announce_written = getattr(redis_schema, "announce_written", None)
    busy = redis_schema.stream_key("busy")
    redis = Redis.from_url(url)
    go.wait()
    for i in range(WRITES):
        # One transaction, as every writer's (a script or MULTI): the delta and its announcement land together.
        with redis.pipeline(transaction=True) as pipeline:
            pipeline.xadd(busy, {"type": "delta", "index": "0", "text": f"t{i}", "num_tokens": str(i + 1)})
            if announce_written is not None:
                announce_written(pipeline, [busy])
            pipeline.execute()
        done.wait()
        done.clear()


async def _measure(url: str, quiet: int, go, done) -> float:
    import contextlib

    from redis.asyncio import Redis as AsyncRedis

    from api.streaming import StreamHub
    from pagedq.redis_schema import stream_key

    connection = AsyncRedis.from_url(url)
    await connection.delete(stream_key("busy"))  # the last count's writes
    hub = StreamHub(connection, block_s=1.0)
    try:
        async with contextlib.AsyncExitStack() as stack:
            for i in range(quiet):
                await stack.enter_async_context(hub.follow(f"quiet-{i}", "0-0"))
            busy = await stack.enter_async_context(hub.follow("busy", "0-0"))
            await asyncio.sleep(1.5)
            started = time.process_time()
            go.set()
            received = 0
            while received < WRITES:
                received += len(await asyncio.wait_for(busy.get(), 30))
                done.set()
            return (time.process_time() - started) / WRITES
    finally:
        await hub.close()
        await connection.aclose()


def main() -> None:
    from pagedq.redis_server import RedisServer

    counts = [int(arg) for arg in sys.argv[1:]] or [0, 500, 2000]
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            for quiet in counts:
                go, done = multiprocessing.Event(), multiprocessing.Event()
                writer = multiprocessing.Process(target=_writer, args=(server.url, go, done), daemon=True)
                writer.start()
                per_write = asyncio.run(_measure(server.url, quiet, go, done))
                writer.join()
                print(f"quiet streams followed {quiet:5d}: {per_write * 1e6:7.0f} us of the hub's CPU per relayed write")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
