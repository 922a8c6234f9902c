"""`pagedq bench submit`: how fast the api accepts jobs. N clients, each on its own
keep-alive connection (opened before the clock starts), send POST /generate with a text
prompt (tokenized by the api) at the same instant, or with `--request-rate` at Poisson
arrivals of that rate (as `vllm bench serve` paces its requests); per-request latency,
from that request's own send, and submits/s.

Without `--url` it starts its own Redis and `pagedq api --workers W` (no engine worker:
the jobs stay queued, so only the submit path is measured). The client is raw asyncio
HTTP/1.1, a few microseconds of CPU per request, because it shares the machine's cores
with what it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from pagedq.bench.latency import percentile
from pagedq.bench.workload import positive_float, positive_int
from pagedq.cli import CommandError

_PROMPT = "Summarize the following note in one sentence: the quick brown fox jumps over the lazy dog, {i} times."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint whose tokenizer the api uses (needed without --url)")
    parser.add_argument("--url", help="a running pagedq api (default: start one here)")
    parser.add_argument("--api-key", help="bearer key for --url")
    parser.add_argument("--concurrency", type=positive_int, default=500, help="requests sent at once (default 500)")
    parser.add_argument("--request-rate", type=positive_float, metavar="PER_S",
                        help="send at Poisson arrivals of this rate instead of all at once")
    parser.add_argument("--rounds", type=positive_int, default=3, help="times to repeat the burst (default 3)")
    parser.add_argument("--api-workers", type=positive_int, default=1, help="`pagedq api --workers` of its own api")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")


async def _burst(
    host: str, port: int, api_key: str | None, count: int, round_index: int, request_rate: float | None = None,
) -> tuple[list[float], float, list[str]]:
    connections = [await asyncio.open_connection(host, port) for _ in range(count)]
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    requests = []
    for i in range(count):
        body = json.dumps({"prompt": _PROMPT.format(i=round_index * count + i), "max_tokens": 16}).encode()
        requests.append(
            f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
    latencies: list[float] = [0.0] * count
    errors: list[str] = []

    async def one(i: int, start: float) -> None:
        reader, writer = connections[i]
        writer.write(requests[i])
        start = time.perf_counter() if request_rate else start
        status_line = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        body = await reader.readexactly(length)
        latencies[i] = time.perf_counter() - start
        if b" 202 " not in status_line:
            errors.append(f"{status_line.decode().strip()}: {body[:200]!r}")
        writer.close()

    start = time.perf_counter()
    if request_rate is None:
        await asyncio.gather(*(one(i, start) for i in range(count)))
    else:
        # Each send waits for its arrival time on the clock, so that the sleeps' own
        # overshoot does not pile up into a lower rate than asked for.
        gaps = random.Random(round_index)
        arrival, sent = 0.0, []
        for i in range(count):
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            sent.append(asyncio.create_task(one(i, start)))
            arrival += gaps.expovariate(request_rate)
        await asyncio.gather(*sent)
    return latencies, time.perf_counter() - start, errors


def _start_api(args: argparse.Namespace, tmp: Path):
    from pagedq.redis_server import RedisServer, free_port

    if not args.model:
        raise CommandError("--model is needed to start an api (its tokenizer)")
    redis_server = RedisServer(tmp / "redis").start()
    port = free_port()
    env = {**os.environ, "PAGEDQ_REDIS_URL": redis_server.url, "PAGEDQ_MODEL": args.model, "PAGEDQ_PORT": str(port),
           "PAGEDQ_HOST": "127.0.0.1", "PAGEDQ_API_KEYS": "", "PAGEDQ_MAX_QUEUE_DEPTH": str(10 * args.concurrency * args.rounds)}
    command = [sys.executable, "-m", "pagedq.cli", "api", "--workers", str(args.api_workers)]
    log = open(tmp / "api.log", "w")
    api = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if api.poll() is not None:
            raise CommandError(f"`pagedq api` exited with {api.returncode}: {(tmp / 'api.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise CommandError("the api did not start within 120 s")
        time.sleep(0.2)
    return url, api, redis_server


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="pagedq-bench-submit-") as tmp:
        api = redis_server = None
        try:
            if args.url:
                url = args.url.rstrip("/")
            else:
                url, api, redis_server = _start_api(args, Path(tmp))
            parts = urlsplit(url)
            host, port = parts.hostname or "127.0.0.1", parts.port or 80
            # Warm-up (not timed): tokenizer, pools, code paths.
            asyncio.run(_burst(host, port, args.api_key, 20, -1))
            rows, failed = [], 0
            pace = f"Poisson arrivals at {args.request_rate:g}/s" if args.request_rate else "all at once"
            print(f"{args.concurrency} POST /generate on their own connections, {pace}, {args.rounds} rounds; "
                  f"api workers: {args.api_workers if not args.url else '?'}; load: {os.getloadavg()[0]:.2f}")
            for round_index in range(args.rounds):
                latencies, seconds, errors = asyncio.run(
                    _burst(host, port, args.api_key, args.concurrency, round_index, args.request_rate)
                )
                failed += len(errors)
                ms = [latency * 1000 for latency in latencies]
                rows.append({"round": round_index + 1, "seconds": seconds, "submits_per_s": args.concurrency / seconds,
                             "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": max(ms),
                             "errors": errors[:3], "load_1m": os.getloadavg()[0]})
                row = rows[-1]
                print(f"round {row['round']}: {row['submits_per_s']:.0f} submits/s, p50 {row['p50_ms']:.1f} ms, "
                      f"p99 {row['p99_ms']:.1f} ms, max {row['max_ms']:.1f} ms, errors {len(errors)}, "
                      f"load {row['load_1m']:.2f}", flush=True)
                for error in errors[:3]:
                    print(f"  {error}")
        finally:
            if api is not None:
                api.terminate()
                try:
                    api.wait(15)
                except subprocess.TimeoutExpired:
                    api.kill()
                    api.wait()
            if redis_server is not None:
                redis_server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"concurrency": args.concurrency, "request_rate": args.request_rate,
                                               "api_workers": args.api_workers, "rounds": rows}, indent=2))
    return 1 if failed else 0
