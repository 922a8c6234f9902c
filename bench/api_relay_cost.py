"""The api's CPU per relayed stream event, or per request, alone: no worker and no engine.
Starts Redis and one `pagedq api`.

Per event (the default): creates STREAMS running jobs, opens GET /stream on each (aiohttp
clients in this process), and writes their deltas straight into Redis from a feeder
process as a worker writes them (one script call a round, announced with the entries), one
per stream every --interval-ms for --rounds rounds, then each one's end.
Prints the api's and Redis's CPU seconds per event. Steadier than `pagedq bench serve` for
the relay's own cost (a spread of about 5% between runs here, against 15%), as nothing else
competes.

Per request (`--requests N`): N clients at once each POST /generate (32-256 prompt token
ids, as `bench serve` sends them), write their job's end into Redis themselves, as a worker
would, and follow GET /stream to that end: the api's CPU for a submission and a stream's
opening and closing, with one event relayed.

    python bench/api_relay_cost.py --model DIR [--streams 256] [--rounds 150] [--interval-ms 20]
    python bench/api_relay_cost.py --model DIR --requests 1024
    python bench/api_relay_cost.py --model DIR --py-spy api.txt   # and where the api's time goes

Before/after: run it from each tree (`cd TREE && PYTHONPATH=TREE python bench/api_relay_cost.py ...`),
alternated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import redis
import redis.asyncio

from pagedq.bench.serve import process_cpu_seconds
from pagedq.local_service import spawn
from pagedq.redis_schema import DELTA_ARGS, EVENT_END, PUBLISH_STEP_SCRIPT, WRITTEN_KEY, publish_end, stream_key
from pagedq.redis_server import free_port, redis_url_or_start
from pagedq.settings import Settings
from rq.job import Job


def _feed(url: str, seq_ids: list[str], rounds: int, interval_s: float) -> None:
    """Writes as the worker does: one PUBLISH_STEP_SCRIPT call per round, its deltas announced
    with their entries (the hub relays them from the announcement, reading no job stream)."""
    connection = redis.Redis.from_url(url)
    keys = [key for seq_id in seq_ids for key in (Job.key_for(seq_id), stream_key(seq_id))] + [WRITTEN_KEY]
    for round_index in range(rounds):
        # Per job: unfenced, one delta of DELTA_ARGS (index, text, num_tokens, new, logprobs, check, ids, first_token).
        delta = ["", 1, 0, " word", round_index + 1, int(round_index == 0), "", 0, "123", time.time()]
        assert len(delta) == 2 + DELTA_ARGS
        connection.eval(PUBLISH_STEP_SCRIPT, len(keys), *keys, 600, *(delta * len(seq_ids)))
        time.sleep(interval_s)
    with connection.pipeline(transaction=False) as pipeline:
        for seq_id in seq_ids:
            publish_end(pipeline, seq_id, "finished", 600, finish_reason="length")
        pipeline.execute()


async def _follow(session: aiohttp.ClientSession, base: str, seq_id: str) -> int:
    async with session.get(f"{base}/stream/{seq_id}") as response:
        if response.status != 200:
            raise SystemExit(f"GET /stream: HTTP {response.status}")
        return sum([1 async for _ in response.content.iter_any()])


async def _submit_and_follow(session: aiohttp.ClientSession, base: str, connection: redis.asyncio.Redis,
                             prompt: list[int]) -> int:
    body = {"prompt_token_ids": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True}
    async with session.post(f"{base}/generate", json=body) as response:
        if response.status != 202:
            raise SystemExit(f"POST /generate: HTTP {response.status}: {await response.text()}")
        seq_id = (await response.json())["seq_id"]
    await connection.xadd(stream_key(seq_id), {"type": EVENT_END, "status": "finished", "finish_reason": "length"})
    return await _follow(session, base, seq_id)


async def _requests(base: str, url: str, count: int) -> int:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 200) for _ in range(rng.randint(32, 256))] for _ in range(count)]
    # A pool that blocks for a free connection rather than refuse a client (redis-py's default cap).
    connection = redis.asyncio.Redis(connection_pool=redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=32))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return sum(await asyncio.gather(*(_submit_and_follow(session, base, connection, prompt) for prompt in prompts)))
    finally:
        await connection.aclose()


async def _streams(base: str, seq_ids: list[str], feeder: multiprocessing.Process) -> int:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        streams = asyncio.gather(*(_follow(session, base, seq_id) for seq_id in seq_ids))
        await asyncio.sleep(0.5)  # every stream open before the first delta
        feeder.start()
        return sum(await streams)


def _py_spy(pid: int, path: str) -> subprocess.Popen:
    executable = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    profiler = subprocess.Popen([executable, "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
                                 "--nonblocking", "--output", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)  # attached before the measurement starts
    return profiler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint the api loads (its tokenizer only)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--requests", type=int, help="measure per request instead: this many at once")
    parser.add_argument("--py-spy", metavar="PATH", help="also profile the api over the measurement with py-spy "
                        "(on PATH or beside this interpreter), its raw samples written here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagedq-relay-") as tmp:
        url, server = redis_url_or_start(None, Path(tmp) / "redis")
        settings = Settings(model=args.model, device="cpu", port=free_port(), cache_dir=Path(tmp), redis_url=url,
                            api_keys=[])
        with open(Path(tmp) / "api.log", "w") as log:
            api = spawn("api", settings, log=log)
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(f"{settings.base_url}/health")
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                raise SystemExit(f"the api did not answer within a minute: {(Path(tmp) / 'api.log').read_text()[-2000:]}")
            api_before, redis_before = process_cpu_seconds(api.pid), process_cpu_seconds(server.process.pid)
            connections_before = redis.Redis.from_url(url).info("stats")["total_connections_received"]
            profiler = _py_spy(api.pid, args.py_spy) if args.py_spy else None
            if args.requests:
                chunks = asyncio.run(_requests(settings.base_url, url, args.requests))
            else:
                chunks = _relay(url, settings.base_url, args)
            api_s = process_cpu_seconds(api.pid) - api_before
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
                profiler.wait()
            redis_s = process_cpu_seconds(server.process.pid) - redis_before
            # This script's own (one, plus the feeder's or the clients' pool) among them.
            connections = redis.Redis.from_url(url).info("stats")["total_connections_received"] - connections_before
        finally:
            api.terminate()
            api.wait()
            server.stop()
    if args.requests:
        print(f"{args.requests} requests (POST /generate, GET /stream to its end): {chunks} chunks received; "
              f"api {api_s:.2f} s of CPU ({1e3 * api_s / args.requests:.2f} ms per request), Redis {redis_s:.2f} s "
              f"({1e3 * redis_s / args.requests:.2f} ms per request); {connections} Redis connections opened")
        return
    events = args.streams * (args.rounds + 1)
    print(f"{args.streams} streams x {args.rounds} deltas + end: {events} events in {chunks} chunks received; "
          f"api {api_s:.2f} s of CPU ({1e6 * api_s / events:.0f} us per event), Redis {redis_s:.2f} s "
          f"({1e6 * redis_s / events:.0f} us per event); {connections} Redis connections opened")


def _relay(url: str, base: str, args: argparse.Namespace) -> int:
    connection = redis.Redis.from_url(url)
    seq_ids = [uuid.uuid4().hex for _ in range(args.streams)]
    for seq_id in seq_ids:
        connection.hset(Job.key_for(seq_id), mapping={"status": "started", "meta": json.dumps({})})
    feeder = multiprocessing.Process(target=_feed, args=(url, seq_ids, args.rounds, args.interval_ms / 1000))
    chunks = asyncio.run(_streams(base, seq_ids, feeder))
    feeder.join()
    return chunks


if __name__ == "__main__":
    main()
