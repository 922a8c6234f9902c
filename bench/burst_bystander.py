"""What a burst of submissions does to a bystander: one client streams a long job while a
burst of POST /generate arrives at once from another client; prints the longest gap between the bystander's
stream events during the burst, and the burst's 202 latencies. Rounds alternate between
the given `--per-turn` values (Settings.api_requests_per_turn; a value above the burst's
size lets the whole burst start in one turn of the api's event loop, as before api/turns.py).

    .venv/bin/python bench/burst_bystander.py --model /tmp/tinyl --burst 1000 --rounds 3 --per-turn 1000000 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from pagedq.local_service import LocalService
from pagedq.redis_server import free_port
from pagedq.settings import Settings


def _follow(base_url: str, seq_id: str, arrivals) -> None:
    """In a process of its own, so that the burst's client (this process) never delays it:
    when each of the stream's events arrives (time.monotonic(), one clock for all processes)."""

    async def follow() -> None:
        async with aiohttp.ClientSession(base_url=base_url) as session, session.get(f"/stream/{seq_id}") as response:
            async for line in response.content:
                if line.startswith(b"event:"):
                    arrivals.append(time.monotonic())

    asyncio.run(follow())


async def _burst(base_url: str, burst: int) -> tuple[float, float, list[float]]:
    async with aiohttp.ClientSession(base_url=base_url, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def submit(index: int) -> float:
            sent = time.monotonic()
            async with session.post("/generate", json={"prompt": f"burst {index} " * 10, "max_tokens": 1}) as response:
                assert response.status == 202, response.status
                await response.read()
            return time.monotonic() - sent

        start = time.monotonic()
        latencies = sorted(await asyncio.gather(*(submit(index) for index in range(burst))))
        return start, time.monotonic(), latencies


def _measure(base_url: str, burst: int) -> str:
    # As long a job as the tiny model's context allows: it streams through the whole burst.
    request = urllib.request.Request(f"{base_url}/generate", data=json.dumps(
        {"prompt": "hello", "max_tokens": 900, "ignore_eos": True}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        seq_id = json.load(response)["seq_id"]
    with multiprocessing.Manager() as manager:
        arrivals = manager.list()
        follower = multiprocessing.Process(target=_follow, args=(base_url, seq_id, arrivals), daemon=True)
        follower.start()
        while len(arrivals) < 20:
            time.sleep(0.01)
        start, end, latencies = asyncio.run(_burst(base_url, burst))
        time.sleep(0.5)
        follower.terminate()
        arrivals = list(arrivals)
    # From the last event before the burst to the burst's end (or the job's, if sooner).
    until = min(end, arrivals[-1])
    first = max(index for index, at in enumerate(arrivals) if at <= start)
    during = [at for at in arrivals[first:] if at <= until] + [until]
    longest_gap = max(later - earlier for earlier, later in zip(during, during[1:]))
    return (f"burst of {burst} in {end - start:.2f} s, 202 p50 {latencies[len(latencies) // 2] * 1000:.0f} ms "
            f"p99 {latencies[int(len(latencies) * 0.99)] * 1000:.0f} ms; bystander: {len(during) - 2} events, "
            f"longest gap {longest_gap * 1000:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--burst", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-turn", type=int, nargs="+", default=[1_000_000, 32])
    args = parser.parse_args()
    for round_number in range(args.rounds):
        for per_turn in args.per_turn:
            with tempfile.TemporaryDirectory() as tmp:
                settings = Settings(model=args.model, device="cpu", port=free_port(), cache_dir=Path(tmp), redis_url=None,
                                    api_keys=[], max_queue_depth=args.burst * 2, api_requests_per_turn=per_turn)
                with open(Path(tmp) / "service.log", "w") as log, LocalService(settings, log=log) as service:
                    line = _measure(service.settings.base_url, args.burst)
            print(f"round {round_number + 1}, per turn {per_turn}, load {os.getloadavg()[0]:.2f}: {line}", flush=True)


if __name__ == "__main__":
    main()
