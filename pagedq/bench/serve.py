"""`pagedq bench serve`: the bench workload through the HTTP service (POST /generate, then
GET /stream for each request), at a fixed concurrency or Poisson arrivals, as `vllm bench
serve` measures it: request and output-token throughput, TTFT, TPOT and inter-token latency.

Without `--url` it starts its own service (Redis, api, one worker) on this machine, and
stops it before running pagedq's offline engine on the same workload (unless
`--no-offline`), so the ratio serve / offline says what the HTTP + Redis path costs.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import os
import random
import ssl
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from pagedq.bench.latency import RequestTiming, summarize
from pagedq.bench.offline import add_model_arguments, resolve_model_and_workload
from pagedq.bench.workload import Workload, add_workload_arguments, positive_float, positive_int
from pagedq.cli import CommandError
from pagedq.client import SSEParser

WARMUP_REQUESTS = 2
WARMUP_OUTPUT_LEN = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_workload_arguments(parser)
    parser.add_argument("--url", help="a running pagedq api serving --model (default: start one here)")
    parser.add_argument("--api-key", help="bearer key for --url")
    load = parser.add_argument_group("load (default: every request at once, i.e. saturation)")
    load = load.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=positive_int, help="at most this many requests in flight")
    load.add_argument("--request-rate", type=positive_float, metavar="PER_S", help="Poisson arrivals at this rate")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                        help="clients follow GET /stream (default); --no-stream: they submit with stream false and "
                        "long-poll GET /result?wait= for the whole text (no TTFT, TPOT or ITL then)")
    parser.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                        help="also run pagedq's offline engine on the same workload and print the ratio (default on)")
    parser.add_argument("--api-workers", type=positive_int,
                        help="api processes of its own service (default: `pagedq up`'s, one per four cores, at most four)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers and their context here")


# ---- the client side ----------------------------------------------------------------


# How long one GET /result?wait= of a --no-stream client waits (the api caps it at PAGEDQ_MAX_WAIT_S).
_RESULT_WAIT_S = 30


class _RequestFailed(Exception):
    """The request's error, as recorded in its timing."""


async def _json(response: aiohttp.ClientResponse, expected_status: int, what: str) -> dict:
    if response.status != expected_status:
        raise _RequestFailed(f"{what}: HTTP {response.status}: {(await response.text())[:200]}")
    return await response.json()


async def _one_request(
    session: aiohttp.ClientSession, prompt: list[int], max_tokens: int, sampling: dict, timing: RequestTiming,
    stream: bool = True,
) -> None:
    # A polling client says so (stream false): its job's partial result is then written now
    # and then, not every step.
    body = {"prompt_token_ids": prompt, "max_tokens": max_tokens, **sampling, "ignore_eos": True, "stream": stream}
    timing.sent = time.perf_counter()
    try:
        async with session.post("/generate", json=body) as response:
            seq_id = (await _json(response, 202, "POST /generate"))["seq_id"]
        timing.accepted = time.perf_counter()
        if stream:
            await _follow_stream(session, seq_id, timing)
        else:
            await _poll_result(session, seq_id, timing)
    except _RequestFailed as exc:
        timing.error = str(exc)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"


async def _follow_stream(session: aiohttp.ClientSession, seq_id: str, timing: RequestTiming) -> None:
    parser, decoder = SSEParser(), codecs.getincrementaldecoder("utf-8")()
    async with session.get(f"/stream/{seq_id}") as response:
        if response.status != 200:
            raise _RequestFailed(f"GET /stream: HTTP {response.status}")
        async for chunk in response.content.iter_any():
            for event, data, _ in parser.feed_text(decoder.decode(chunk)):
                if event == "delta" and data["num_tokens"] > timing.output_tokens:
                    timing.chunk_arrivals.append(time.perf_counter())
                    timing.output_tokens = data["num_tokens"]
                elif event == "reset":  # the job was retried on another worker: it starts over
                    timing.chunk_arrivals.clear()
                    timing.output_tokens = 0
                elif event == "end":
                    if data["status"] != "finished":
                        raise _RequestFailed(f"job {seq_id} ended {data['status']}")
                    timing.finished = time.perf_counter()
                    return
    raise _RequestFailed(f"job {seq_id}: the stream ended without an end event")


async def _poll_result(session: aiohttp.ClientSession, seq_id: str, timing: RequestTiming) -> None:
    """A client that does not stream: long-polls the result until the job ends."""
    while True:
        async with session.get(f"/result/{seq_id}", params={"wait": _RESULT_WAIT_S}) as response:
            result = await _json(response, 200, "GET /result")
        if result["status"] in ("queued", "running"):
            continue
        if result["status"] != "finished":
            raise _RequestFailed(f"job {seq_id} ended {result['status']}")
        timing.finished = time.perf_counter()
        timing.output_tokens = len(result["token_ids"])
        return


async def _run_load(
    base_url: str, api_key: str | None, workload: Workload, concurrency: int | None, request_rate: float | None,
    stream: bool = True,
) -> tuple[list[RequestTiming], float]:
    timings = [RequestTiming(sent=0.0) for _ in workload.prompts]
    gate = asyncio.Semaphore(concurrency or len(timings))
    arrivals = random.Random(workload.seed)
    sampling = workload.sampling_fields()
    # aiohttp, as `vllm bench serve` uses: its C HTTP parser costs the client a fraction of
    # what a pure-Python one does per streamed event, and the client shares the machine's
    # cores with the service it measures. One keep-alive connection per request in flight.
    session = aiohttp.ClientSession(
        base_url=base_url,
        headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        connector=aiohttp.TCPConnector(limit=concurrency or len(timings), ssl=ssl.create_default_context()),
    )

    async def gated(index: int) -> None:
        async with gate:
            await _one_request(
                session, workload.prompts[index], workload.output_lens[index], sampling, timings[index], stream,
            )

    try:
        start = time.perf_counter()
        tasks = []
        for index in range(len(timings)):
            if request_rate is not None and index:
                await asyncio.sleep(arrivals.expovariate(request_rate))
            tasks.append(asyncio.create_task(gated(index)))
        await asyncio.gather(*tasks)
        return timings, time.perf_counter() - start
    finally:
        await session.close()


def process_cpu_seconds(pid: int) -> float | None:
    """A process's user + system CPU time so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pids: list[int]) -> float | None:
    seconds = [process_cpu_seconds(pid) for pid in pids]
    return None if None in seconds else sum(seconds)


def _child_pids(pid: int) -> list[int]:
    """A process's children (Linux /proc; none elsewhere)."""
    pids = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids += [int(child) for child in children.read_text().split()]
        except OSError:
            continue
    return pids


def measure_service(
    base_url: str, api_key: str | None, workload: Workload, args: argparse.Namespace,
    processes: dict[str, list[int]] | None = None, engine_steps: Callable[[], int] | None = None,
) -> dict:
    """Warm the service up (not timed), then run the workload; latency.summarize()'s dict,
    with `cpu_s`: the CPU seconds each of `processes` (name: its pids, summed) and this
    client spent on the timed run (CPU time, unlike wall time, does not depend on what else
    the machine runs); with `engine_steps` (the steps the service's engines have run so
    far), `engine_steps`: those of the timed run."""
    stream = getattr(args, "stream", True)
    warmup, _ = asyncio.run(_run_load(base_url, api_key, workload.head(WARMUP_REQUESTS, WARMUP_OUTPUT_LEN), None, None, stream))
    failed = [t.error for t in warmup if not t.ok]
    if failed:
        raise CommandError(f"the service at {base_url} failed a warm-up request: {failed[0]}")
    processes = processes or {}
    steps_before = engine_steps() if engine_steps else None
    cpu_before = {name: _cpu_seconds(pids) for name, pids in processes.items()}
    client_before = time.process_time()
    timings, duration = asyncio.run(_run_load(base_url, api_key, workload, args.concurrency, args.request_rate, stream))
    summary = summarize(timings, duration)
    summary["cpu_s"] = {name: _cpu_seconds(pids) - cpu_before[name] for name, pids in processes.items() if cpu_before[name] is not None}
    summary["cpu_s"]["client"] = time.process_time() - client_before
    if engine_steps:
        summary["engine_steps"] = engine_steps() - steps_before
    summary["errors"] = sorted({t.error for t in timings if t.error})
    return summary


def _engine_steps_reader(settings) -> Callable[[], int]:
    """The steps the engines of the service's live workers have run so far, from the stats
    each worker writes with every round trip (as GET /ready shows them): the stats of the
    round trip that wrote a job's result are those of the step that finished it, so read
    once every result is in, they count every step of the run."""
    from rq import Queue

    from pagedq.live_workers import live_workers
    from pagedq.redis_connection import connect

    connection = connect(settings.redis_url)
    queue = Queue(settings.queue_name, connection=connection)

    def steps() -> int:
        return sum((worker["engine"] or {}).get("steps", 0) for worker in live_workers(connection, queue))

    return steps


# ---- the run ------------------------------------------------------------------------


def _own_service_settings(args: argparse.Namespace, workload: Workload, cache_dir: Path):
    from pagedq.redis_server import free_port
    from pagedq.settings import Settings

    # Explicit values win over any PAGEDQ_* variables in the environment (a key would lock us out).
    return Settings(
        model=args.model, device=args.device, dtype=args.dtype, port=free_port(), cache_dir=cache_dir,
        redis_url=None, api_keys=[], max_queue_depth=max(workload.num_requests, WARMUP_REQUESTS),
    ).with_overrides(api_workers=args.api_workers)


def _serve(args: argparse.Namespace, workload: Workload) -> tuple[dict, str]:
    """The service's numbers, and where they came from."""
    if args.url:
        return measure_service(args.url.rstrip("/"), args.api_key, workload, args), args.url
    from pagedq.local_service import LocalService, StartupFailed

    with tempfile.TemporaryDirectory(prefix="pagedq-bench-serve-") as tmp:
        log_path = Path(tmp) / "service.log"
        with open(log_path, "w") as log:
            service = LocalService(_own_service_settings(args, workload, Path(tmp)), log=log)
            try:
                service.start()
            except StartupFailed as exc:
                raise CommandError(f"{exc}; its log:\n{log_path.read_text()[-4000:]}") from None
            worker = service.children[1].pid
            # The worker's engine core, when it runs in a process of its own (the default),
            # and the api's processes beyond the first (uvicorn's workers, with --api-workers).
            api = service.children[0].pid
            processes = {"worker": [worker], "api": [api, *_child_pids(api)]}
            if cores := _child_pids(worker):
                processes["engine core"] = cores
            if service.redis_server is not None and service.redis_server.process is not None:
                processes["redis"] = [service.redis_server.process.pid]
            try:
                summary = measure_service(service.settings.base_url, None, workload, args, processes,
                                          _engine_steps_reader(service.settings))
            finally:
                service.stop()
    api_workers = service.settings.api_workers
    return summary, (f"its own service on this machine: Redis, `pagedq api` ({api_workers} process"
                     f"{'es' if api_workers > 1 else ''}), one `pagedq worker`")


def _ms(summary: dict, metric: str, stat: str) -> str:
    values = summary.get(metric)
    return f"{values[stat]:.1f}" if values else "-"


def serve_table(serve: dict, offline: dict | None) -> str:
    from pagedq.bench.report import format_table

    header = ["run", "requests", "output tokens", "seconds", "req/s", "output tok/s", "202 p50", "202 p99",
              "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99"]
    rows = [[
        "pagedq serve (HTTP + Redis)", f"{serve['completed']}/{serve['requests']}", str(serve["output_tokens"]),
        f"{serve['duration_s']:.2f}", f"{serve['request_throughput']:.2f}", f"{serve['output_tokens_per_s']:.1f}",
        *(_ms(serve, metric, stat) for metric in ("accept_ms", "ttft_ms", "tpot_ms", "itl_ms") for stat in ("p50", "p99")),
    ]]
    if offline is not None:
        rows.append([
            "pagedq offline (LLM.generate)", f"{offline['requests']}/{offline['requests']}", str(offline["output_tokens"]),
            f"{offline['seconds']:.2f}", f"{offline['requests'] / offline['seconds']:.2f}",
            f"{offline['output_tokens_per_s']:.1f}", *["-"] * 8,
        ])
    return format_table(header, rows) + "\n(latencies in ms)"


def cpu_seconds_line(cpu: dict[str, float], offline: dict | None) -> str:
    """Each process's CPU seconds in the timed serve run, the offline run's, and the service's
    over the offline run's: not for a service at --url (another's, of which only the client
    is measured)."""
    line = "CPU seconds of the timed serve run: " + ", ".join(f"{name} {seconds:.1f}" for name, seconds in cpu.items())
    if offline is not None and offline.get("cpu_seconds"):
        line += f"; offline {offline['cpu_seconds']:.1f}"
        service_cpu = sum(seconds for name, seconds in cpu.items() if name != "client")
        if service_cpu:
            line += f"; service (worker, its engine core, api, redis) / offline: {service_cpu / offline['cpu_seconds']:.2f}x"
    return line


def engine_steps_line(serve: dict, offline: dict | None) -> str:
    """The steps each engine took for the same tokens: the service's engine takes more when
    its batches run less full (jobs reach it as the front accepts and starts them)."""
    def steps(run: dict) -> str:
        return f"{run['engine_steps']} ({run['output_tokens'] / max(run['engine_steps'], 1):.1f} output tokens a step)"

    line = f"engine steps of the timed run: serve {steps(serve)}"
    if offline is not None and offline.get("engine_steps") is not None:
        line += f", offline {steps(offline)}"
    return line


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedq.bench.pagedq_peer import PagedqPeer
    from pagedq.bench.peer import measure
    from pagedq.bench.report import device_description, model_description, versions, write_json
    from worker.host_threads import set_torch_threads
    from worker.rq.engine_factory import torch_threads

    hf_config, device, dtype, workload = resolve_model_and_workload(args)
    load = (f"concurrency {args.concurrency}" if args.concurrency
            else f"Poisson {args.request_rate}/s" if args.request_rate else "all requests at once")
    print(f"model {args.model}; {workload.num_requests} requests, input {workload.input_len}, output "
          f"{workload.output_len}, {'greedy' if workload.temperature == 0 else f'temperature {workload.temperature}'}, "
          f"ignore_eos; load: {load}; clients {'stream' if args.stream else 'poll results (--no-stream)'}", flush=True)

    serve, served_by = _serve(args, workload)
    print(f"served by {served_by}", flush=True)
    offline = None
    if args.offline:
        # The worker's thread count (see worker.rq.engine_factory), so the ratio isolates the HTTP + Redis path.
        threads = torch_threads(_own_service_settings(args, workload, Path()), device)
        if threads is not None:
            set_torch_threads(threads)
        peer = PagedqPeer(args.model, device, dtype, args.seed)
        offline = measure(peer, workload, device, progress=False).summary()
        offline["torch_threads"] = torch.get_num_threads()
        offline["engine_steps"] = peer.last_steps

    print()
    print(serve_table(serve, offline))
    ratio = serve["output_tokens_per_s"] / offline["output_tokens_per_s"] if offline else None
    if ratio is not None:
        print(f"\nserve / offline output throughput: {ratio:.2f}x")
    if serve.get("cpu_s"):
        print(cpu_seconds_line(serve["cpu_s"], offline))
    if "engine_steps" in serve:
        print(engine_steps_line(serve, offline))
    if serve["tokens_per_event"] is not None:
        api_cost = (f"; api CPU per output token {serve['cpu_s']['api'] / serve['output_tokens'] * 1e6:.0f} us"
                    if "api" in serve["cpu_s"] else "")
        print(f"streamed: {serve['streamed_events']} delta events, {serve['tokens_per_event']:.2f} tokens each{api_cost}")
    if args.json:
        write_json(args.json, args, {
            "device": device_description(device),
            "dtype": str(dtype).removeprefix("torch."),
            "versions": versions(),
            "model": model_description(args.model, hf_config),
            "workload": workload.summary(),
            "load": load,
            "stream": args.stream,
            "served_by": served_by,
            "serve": serve,
            "offline": offline,
            "serve_over_offline": ratio,
        })
    for error in serve["errors"]:
        print(f"FAILED: {error}")
    return 1 if serve["failed"] else 0
