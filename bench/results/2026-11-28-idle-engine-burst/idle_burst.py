"""How soon an idle worker's engine starts on a burst it takes in one round trip: the
service (Redis, one api, one worker) on this machine; each round suspends the worker
(`rq suspend`), queues --jobs jobs (--prompt-len random ids below 512, inside every tiny
preset's vocabulary; --max-tokens, greedy, ignore_eos), resumes it, and reads each job's
timings from its result: when the engine got it (`started`) and its first token, counted
from the moment RQ's bookkeeping marked the burst's first job started (the round trip that
took the burst had answered by then; when the worker noticed the resume does not count).

    PYTHONPATH=TREE python idle_burst.py --model /tmp/hostm [--jobs 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timezone
from pathlib import Path

import httpx
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.suspension import resume, suspend

from pagedq.local_service import LocalService
from pagedq.redis_server import free_port
from pagedq.settings import Settings


def _wait(what, predicate, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise TimeoutError(what)


def _quantiles(values: list[float]) -> str:
    deciles = statistics.quantiles(values, n=10)
    return f"p10 {deciles[0] * 1e3:.0f} / p50 {statistics.median(values) * 1e3:.0f} / p90 {deciles[-1] * 1e3:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "service.log", "w") as log:
        settings = Settings(model=args.model, device="cpu", port=free_port(), cache_dir=Path(tmp), redis_url=None,
                            api_keys=[], max_queue_depth=10 * args.jobs, reaper_interval_s=0.2)
        with LocalService(settings, log=log) as service:
            url, redis = service.settings.base_url, Redis.from_url(service.settings.redis_url)
            http = httpx.Client(base_url=url, timeout=60)
            for round_index in range(args.rounds):
                suspend(redis)
                _wait("the worker to suspend",
                      lambda: {w["state"] for w in http.get("/ready").json()["workers"]} == {"suspended"})
                bodies = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(args.prompt_len)],
                           "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": False}
                          for _ in range(args.jobs)]
                with ThreadPoolExecutor(16) as pool:
                    seq_ids = list(pool.map(lambda body: http.post("/generate", json=body).json()["seq_id"], bodies))
                resume(redis)
                results = [_wait("a result", lambda s=seq_id: (r := http.get(f"/result/{s}").json())["status"] == "finished"
                                 and r) for seq_id in seq_ids]
                marked = min(Job.fetch(seq_id, connection=redis, serializer=JSONSerializer).started_at.replace(tzinfo=timezone.utc).timestamp()
                             for seq_id in seq_ids)
                handed = [r["timings"]["started"] - marked for r in results]
                first = [r["timings"]["first_token"] - marked for r in results]
                print(f"round {round_index + 1} (load {' '.join(open('/proc/loadavg').read().split()[:3])}): "
                      f"engine got its first job after {min(handed) * 1e3:.0f} ms, the last after "
                      f"{max(handed) * 1e3:.0f} ms; first token {_quantiles(first)} (from RQ's first start)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
