"""The api's stream hub's CPU per relayed write, against how many quiet streams it follows.

One busy stream gets WRITES deltas, written as the worker writes them (its ProgressPublisher:
one script call that writes the delta and announces it in redis_schema.WRITTEN_KEY), one at a
time, each waited for at the follower, while the hub also follows QUIET streams nobody writes
to (queued jobs' streams, clients waiting). Prints this process's CPU microseconds per
relayed write (the writer is another process). Run with PYTHONPATH=TREE to measure TREE's hub:

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
    from rq.job import Job

    from pagedq.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from pagedq.redis_schema import JOB_SERIALIZER
    from worker.rq.publisher import ProgressPublisher

    redis = Redis.from_url(url)
    publisher = ProgressPublisher(redis, stream_ttl_s=600, progress_interval_s=0.0)
    # Never saved: the unfenced writes of flush() need no job hash.
    publisher.track(Job.create("builtins.print", connection=redis, id="busy", serializer=JOB_SERIALIZER))
    text, token_ids = "", []
    go.wait()
    for i in range(WRITES):
        text, token_ids = text + f"t{i}", token_ids + [i]
        completion = CompletionOutput(0, text, list(token_ids), None, None)
        publisher.update("busy", RequestOutput("busy", None, [1], [completion], False, RequestMetrics(time.time())))
        publisher.flush()
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
