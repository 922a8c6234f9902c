"""Non-streamed OpenAI completions at once against `pagedq up` started from a source tree:
the CPU seconds its worker, engine core and api spent on them (the load that polling OpenAI
clients and batch lines put on the worker, which `pagedq bench serve`'s native clients do not).

    python bench/openai_unstreamed_load.py TREE [--model DIR] [--port N] [--requests N]

TREE: a checkout (e.g. `git archive <commit> | tar -x -C TREE`), run with this interpreter;
alternate trees for a before/after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp

from pagedq.bench.serve import process_cpu_seconds


def _cpu_seconds(pids: list[int]) -> float:
    return sum(process_cpu_seconds(pid) or 0.0 for pid in pids)


def _pids(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found if int(pid) != os.getpid()]


async def _load(base: str, model: str, requests: int) -> tuple[int, float, dict[str, float]]:
    rng = random.Random(0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(600):
            try:
                async with session.get(base + "/ready") as reply:
                    if reply.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1)

        async def complete(max_tokens: int) -> int:
            body = {"model": model, "prompt": [rng.randrange(10, 500) for _ in range(rng.randint(32, 256))],
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.6}
            async with session.post(base + "/v1/completions", json=body) as reply:
                answer = await reply.json()
                if "usage" not in answer:
                    raise SystemExit(f"the service refused a request: {answer}")
                return answer["usage"]["completion_tokens"]

        await complete(4)  # warm-up, not counted
        processes = {"worker": _pids("pagedq.cli worker"), "engine core": _pids("pagedq.core.process"),
                     "api": _pids("pagedq.cli api")}
        before = {name: _cpu_seconds(pids) for name, pids in processes.items()}
        started = time.time()
        tokens = await asyncio.gather(*(complete(rng.randint(32, 256)) for _ in range(requests)))
        seconds = time.time() - started
        return sum(tokens), seconds, {name: _cpu_seconds(pids) - before[name] for name, pids in processes.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tree")
    parser.add_argument("--model", default="/tmp/tinyl")
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--requests", type=int, default=512)
    args = parser.parse_args()
    env = dict(os.environ, PAGEDQ_MAX_QUEUE_DEPTH=str(2 * args.requests))
    with tempfile.TemporaryFile() as log:
        up = subprocess.Popen([sys.executable, "-m", "pagedq.cli", "up", "--model", args.model, "--port", str(args.port)],
                              cwd=args.tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            tokens, seconds, cpu = asyncio.run(_load(f"http://127.0.0.1:{args.port}", args.model, args.requests))
        finally:
            os.killpg(up.pid, signal.SIGINT)
            up.wait(60)
    print(f"{args.tree}: {tokens} tokens in {seconds:.2f} s ({tokens / seconds:,.0f} tok/s); CPU s: "
          + ", ".join(f"{name} {value:.2f}" for name, value in cpu.items()) + f"; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
