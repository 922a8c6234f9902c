"""Count the Redis commands the service spends per job.

Starts its own Redis, api and one worker (pagedq.local_service) on MODEL, warms them up,
then runs NUM_JOBS requests (all at once, fixed prompt and output lengths, clients that
stream or that long-poll the result) twice: once measuring Redis's own CPU time, once
while a MONITOR connection records every command Redis executes. Prints, per job: the
commands clients sent (round trips are fewer: the service pipelines), the commands
scripts ran inside Redis, the top commands of each, and Redis CPU time (so jobs/s one
Redis core carries).

    .venv/bin/python bench/count_redis_commands.py --model DIR [--num-jobs 256] [--output-len 64] [--no-stream]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import tempfile
import threading
import time
from pathlib import Path

import redis

from pagedq.bench.serve import _run_load
from pagedq.bench.workload import LengthRange, Workload
from pagedq.local_service import LocalService
from pagedq.redis_server import free_port
from pagedq.settings import Settings


_STOP_MARKER = "pagedq-count-redis-commands-stop"


def _monitor(url: str, counts: dict[str, collections.Counter], ready: threading.Event) -> None:
    """Count what MONITOR shows until it shows our ECHO of _STOP_MARKER (a socket timeout would end MONITOR)."""
    with redis.Redis.from_url(url).monitor() as monitor:
        ready.set()
        while True:
            command = monitor.next_command()
            if _STOP_MARKER in command["command"]:
                return
            source = "script" if command.get("client_type") == "lua" else "client"
            counts[source][command["command"].split(" ", 1)[0].strip('"').upper()] += 1


def _redis_cpu_s(connection: redis.Redis) -> float:
    cpu = connection.info("cpu")
    return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-jobs", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    workload = Workload(
        prompts=[[(7 * i + j) % 200 + 10 for j in range(args.input_len)] for i in range(args.num_jobs)],
        output_lens=[args.output_len] * args.num_jobs, temperature=0.0, seed=0,
        input_len=LengthRange(args.input_len, args.input_len), output_len=LengthRange(args.output_len, args.output_len),
    )
    with tempfile.TemporaryDirectory(prefix="pagedq-count-") as tmp, open(Path(tmp) / "service.log", "w") as log:
        settings = Settings(model=args.model, device="cpu", port=free_port(), cache_dir=Path(tmp), redis_url=None,
                            api_keys=[], max_queue_depth=args.num_jobs + 16)
        with LocalService(settings, log=log) as service:
            url = service.settings.base_url
            asyncio.run(_run_load(url, None, workload.head(4, 4), None, None, args.stream))
            time.sleep(1.0)  # the warm-up's last writes
            # First pass without MONITOR (which costs Redis more than the commands do): Redis's own CPU time.
            stats = redis.Redis.from_url(service.settings.redis_url)
            cpu_before = _redis_cpu_s(stats)
            asyncio.run(_run_load(url, None, workload, None, None, args.stream))
            time.sleep(1.0)
            redis_cpu_s = _redis_cpu_s(stats) - cpu_before
            counts = {"client": collections.Counter(), "script": collections.Counter()}
            ready = threading.Event()
            thread = threading.Thread(target=_monitor, args=(service.settings.redis_url, counts, ready), daemon=True)
            thread.start()
            ready.wait()
            started = time.perf_counter()
            timings, _ = asyncio.run(_run_load(url, None, workload, None, None, args.stream))
            elapsed = time.perf_counter() - started
            redis.Redis.from_url(service.settings.redis_url).echo(_STOP_MARKER)
            thread.join()
    done = sum(t.ok for t in timings)
    print(f"{done}/{args.num_jobs} jobs ({args.input_len} in / {args.output_len} out, all at once, "
          f"{'streaming' if args.stream else 'long-polling'} clients) in {elapsed:.1f}s")
    for source in ("client", "script"):
        total = sum(counts[source].values())
        top = ", ".join(f"{name} {count / args.num_jobs:.1f}" for name, count in counts[source].most_common(12))
        print(f"{source} commands per job: {total / args.num_jobs:.1f}   ({top})")
    print(f"all commands per job: {sum(sum(c.values()) for c in counts.values()) / args.num_jobs:.1f}")
    print(f"Redis CPU per job (a pass without MONITOR): {redis_cpu_s / args.num_jobs * 1e6:.0f} us "
          f"-> {args.num_jobs / redis_cpu_s:.0f} jobs/s per Redis core at this workload")


if __name__ == "__main__":
    main()
