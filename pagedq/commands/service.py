"""Service commands: `pagedq up | submit | result | cancel | api | worker`.

Flags override the `PAGEDQ_*` environment (pagedq/settings.py); `pagedq up` hands its
resolved settings to its children through that same environment.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from pydantic import ValidationError

from pagedq.cli import CommandError
from pagedq.request_rules import IDEMPOTENCY_KEY
from pagedq.settings import Settings

if TYPE_CHECKING:
    from pagedq.client import Client

def register_start(subparsers) -> None:
    """The commands a user starts with: `up` and `submit`."""
    up = subparsers.add_parser(
        "up", help="run Redis, the api and a worker on this machine (start here)",
        description="Run the whole service on this machine: Redis (PAGEDQ_REDIS_URL, else redis-server on PATH, "
        "else the bundled one), the api and --workers workers. Without --model it serves SmolLM2-135M-Instruct "
        "(fetched once by `pagedq pull`). Prints the api's URL when every worker is ready; Ctrl-C stops the "
        "workers (they requeue what they cannot finish), then the api, then Redis.")
    _server_flags(up, "up")
    up.add_argument("--workers", type=int, default=1, help="worker processes, each with its own engine (default 1)")
    up.add_argument("--api-workers", type=int, help="api processes sharing the port (PAGEDQ_API_WORKERS; default: one "
                    "per four cores, at most four)")
    up.set_defaults(handler=cmd_up)

    submit = subparsers.add_parser(
        "submit", help="send one prompt to a running service (--wait or --stream for the answer)",
        description="Queue one prompt; print its job id, or with --wait its answer, or with --stream the answer as "
        "it is generated. Sampling flags left out take the checkpoint's generation_config.json defaults.")
    client_flags(submit)
    submit.add_argument("prompt", type=utf8_text, help="the prompt text (with --chat: the user's message)")
    submit.add_argument("--chat", action="store_true", help="send the prompt as a user message through the model's chat template")
    mode = submit.add_mutually_exclusive_group()
    mode.add_argument("--wait", action="store_true", help="wait for the job and print its text")
    mode.add_argument("--stream", action="store_true", help="print the text as it is generated")
    sampling_flags(submit)
    submit.add_argument("--top-k", type=int, help="sample from the k likeliest tokens only (-1 or 0: all)")
    submit.add_argument("--priority", type=int, help="lower runs earlier (default 0)")
    submit.add_argument("--idempotency-key", type=idempotency_key,
                        help="the same key and prompt give the same job, however often sent (1-255 printable ASCII characters)")
    submit.add_argument("--json", action="store_true", help="print the full JSON result")
    submit.set_defaults(handler=cmd_submit)


def register(subparsers) -> None:
    """The service's parts and a job's other commands: `result`, `cancel`, `api`, `worker`."""
    result = subparsers.add_parser("result", help="show a job's status and (partial) result",
                                   description="Print a job's status and result so far as JSON.")
    client_flags(result)
    result.add_argument("seq_id", type=an_id, help="the job id `submit` printed")
    result.add_argument("--wait", type=float, help="wait up to this many seconds for the job to end")
    result.set_defaults(handler=cmd_result)

    cancel = subparsers.add_parser("cancel", help="cancel a queued or running job",
                                   description="Cancel a job: a queued one never runs, a running one stops.")
    client_flags(cancel)
    cancel.add_argument("seq_id", type=an_id, help="the job id `submit` printed")
    cancel.set_defaults(handler=cmd_cancel)

    api = subparsers.add_parser(
        "api", help="serve the HTTP api alone (uvicorn), for a service spread over machines",
        description="Serve the HTTP api (native, OpenAI-compatible and Batch API routes) on --host:--port. Any "
        "number of api processes may serve one Redis; each needs the model's tokenizer and config.")
    _server_flags(api, "api")
    api.add_argument("--workers", type=int, dest="api_workers",
                     help="api processes sharing the port (uvicorn workers; PAGEDQ_API_WORKERS, default: one per four "
                     "cores, at most four): more cores for submits and streams")
    api.set_defaults(handler=cmd_api)

    worker = subparsers.add_parser(
        "worker", help="run one engine that takes many jobs at once from Redis (one per GPU)",
        description="Run a worker: it loads the model, takes as many queued jobs as its engine admits, and writes "
        "their tokens and results to Redis. Start one per GPU (or several per CPU machine), on any machine that "
        "reaches Redis; it serves no HTTP (its Prometheus metrics: PAGEDQ_METRICS_PORT on --host).")
    _server_flags(worker, "worker")
    worker.set_defaults(handler=cmd_worker)


def _server_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """The settings flags of `up`, `api` and `worker` (each overrides its PAGEDQ_* variable)."""
    parser.add_argument("--model", help="local Hugging Face checkpoint directory, e.g. what `pagedq pull` prints "
                        "(PAGEDQ_MODEL)" + ("; default: SmolLM2-135M-Instruct, pulled once" if role == "up" else ""))
    parser.add_argument("--redis-url", help="redis://HOST:PORT/DB or redis+sentinel://... (PAGEDQ_REDIS_URL)"
                        + ("; default: start a local Redis" if role == "up" else ""))
    if role == "worker":
        parser.add_argument("--host", help="address the worker's metrics listen on (PAGEDQ_HOST, default 127.0.0.1)")
    else:
        parser.add_argument("--host", help="address the api listens on (PAGEDQ_HOST, default 127.0.0.1)")
        parser.add_argument("--port", type=int, help="port the api listens on (PAGEDQ_PORT, default 8000)")
        parser.add_argument("--disable-uvicorn-access-log", action="store_true", default=None,
                            help="no log line per HTTP request (PAGEDQ_DISABLE_UVICORN_ACCESS_LOG)")
    if role != "worker":
        parser.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                            help='let chat requests with tools use tool_choice "auto" (their default): the model\'s own '
                            "tool calls are parsed out of its text; needs --tool-call-parser (PAGEDQ_ENABLE_AUTO_TOOL_CHOICE)")
        parser.add_argument("--tool-call-parser", choices=("llama3_json", "hermes", "mistral"),
                            help="how the model writes tool calls: llama3_json (Llama 3.1-3.3), hermes (Hermes, Qwen "
                            "2.5/3) or mistral (PAGEDQ_TOOL_CALL_PARSER)")
        parser.add_argument("--structured-outputs-disable-any-whitespace", action="store_true", default=None,
                            help="JSON structured outputs without whitespace between tokens unless a request sends "
                            "disable_any_whitespace (small models often loop on whitespace otherwise; "
                            "PAGEDQ_STRUCTURED_OUTPUTS_DISABLE_ANY_WHITESPACE)")
    parser.add_argument("--queue-name", help="RQ queue the api fills and workers take from (PAGEDQ_QUEUE_NAME, "
                        "default pagedq; batches use QUEUE.batch)")
    parser.add_argument("--device", help="auto, cpu or cuda (PAGEDQ_DEVICE, default auto)")
    parser.add_argument("--dtype", help="weights and activations: auto (the checkpoint's), float32, float16 or "
                        "bfloat16 (PAGEDQ_DTYPE)")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + output in tokens (PAGEDQ_MAX_MODEL_LEN; "
                        "default: the model's, lowered to what the KV cache holds)")
    parser.add_argument("--max-num-seqs", type=int, help="sequences one engine step runs at most "
                        "(PAGEDQ_MAX_NUM_SEQS, default 256)")
    parser.add_argument("--max-seqs-per-request", type=int, help="sequences one request (n, beam_width) runs at "
                        "most, so none holds every slot (PAGEDQ_MAX_SEQS_PER_REQUEST, default half of max-num-seqs)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="tokens per engine step (PAGEDQ_MAX_NUM_BATCHED_TOKENS)")
    parser.add_argument("--gpu-memory-utilization", type=float, help="share of the GPU's memory for weights and "
                        "KV cache, 0-1 (PAGEDQ_GPU_MEMORY_UTILIZATION)")
    parser.add_argument("--kv-cache-dtype", help="auto or fp8 (e4m3: twice the tokens per GiB) (PAGEDQ_KV_CACHE_DTYPE)")
    parser.add_argument("--preemption-mode", help="when the KV cache is full: recompute or swap (to CPU memory) "
                        "(PAGEDQ_PREEMPTION_MODE)")
    parser.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs (PAGEDQ_ENFORCE_EAGER)")
    parser.add_argument("--tensor-parallel-size", type=int, help="devices each worker splits the model across "
                        "(PAGEDQ_TENSOR_PARALLEL_SIZE, default 1)")


def finite_float(text: str) -> float:
    """An argparse type: a finite number (float() takes "nan" and "inf", which no JSON body can carry)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
    return value


def utf8_text(text: str) -> str:
    """An argparse type: text that is valid UTF-8 (Python keeps an argument's undecodable bytes
    as lone surrogates, which no request can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 text (at character {exc.start})") from None
    return text


def an_id(text: str) -> str:
    """An argparse type: a job's or batch's id, as printed: not empty, valid UTF-8."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return utf8_text(text)


def idempotency_key(text: str) -> str:
    """An argparse type: what the api takes as an Idempotency-Key header (1-255 printable ASCII characters)."""
    if not IDEMPOTENCY_KEY.fullmatch(text):
        raise argparse.ArgumentTypeError("must be 1-255 printable ASCII characters, no spaces")
    return text


def sampling_flags(parser: argparse.ArgumentParser) -> None:
    """The sampling flags `pagedq submit` and `pagedq batch submit` share (SamplingParams' names)."""
    parser.add_argument("--max-tokens", type=int, help="most tokens to generate (per summary with --summarize)")
    parser.add_argument("--temperature", type=finite_float,
                        help="0: greedy; higher: more varied (default: the checkpoint's)")
    parser.add_argument("--top-p", type=finite_float, help="sample from the likeliest tokens that make up this probability")
    parser.add_argument("--seed", type=int, help="seed the sampling, for a repeatable answer")
    parser.add_argument("--stop", action="append", type=utf8_text, help="stop when the text contains this string (repeatable)")


def given_fields(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    """The named flags the user gave (left out: the server's defaults apply)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop")


def client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="the api's base URL (PAGEDQ_URL, default http://127.0.0.1:8000)")
    parser.add_argument("--api-key", help="the bearer key, when the api needs one (PAGEDQ_API_KEY)")


def _settings(args: argparse.Namespace) -> Settings:
    try:
        return Settings().with_overrides(**vars(args))
    except ValidationError as exc:
        raise CommandError(f"invalid settings: {exc}") from None


# ---- servers ------------------------------------------------------------------------


def cmd_api(args: argparse.Namespace) -> int:
    before = _stop_on_signals_while_starting()
    import uvicorn

    from api.app import create_app

    settings = _settings(args)
    try:
        app = create_app(settings)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    # uvicorn's handlers take over now (a graceful shutdown). After it, uvicorn raises the
    # signal again: that must do what it did before this process started, not exit 128 + it.
    for signum, handler in before.items():
        signal.signal(signum, handler)
    if settings.api_workers == 1:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="info",
                    access_log=not settings.disable_uvicorn_access_log)
        return 0
    # Each worker process builds its own app from these settings (as PAGEDQ_* variables);
    # their Prometheus counters meet in one directory, so any of them answers /metrics for all.
    with tempfile.TemporaryDirectory(prefix="pagedq-api-metrics-") as metrics_dir:
        os.environ.update(settings.to_env())
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        uvicorn.run("api.app:app_from_environment", factory=True, workers=settings.api_workers,
                    host=settings.host, port=settings.port, log_level="info",
                    access_log=not settings.disable_uvicorn_access_log)
    return 0


def _stop_while_starting(signum: int, frame) -> None:
    # Nothing runs yet: exit now, a worker's engine core process with us (ProcessCoreClient stops it).
    raise SystemExit(128 + signum)


def _stop_on_signals_while_starting() -> dict:
    """SIGINT and SIGTERM stop a process that is still starting (importing, building the
    api's app, loading the engine) at once, until the server's or RQ's own handlers replace
    these. Set even where SIGINT came in ignored (a process started in a script's
    background), where it would otherwise be lost until those handlers took over. Returns
    the handlers they replace."""
    return {signum: signal.signal(signum, _stop_while_starting) for signum in (signal.SIGINT, signal.SIGTERM)}


def cmd_worker(args: argparse.Namespace) -> int:
    _stop_on_signals_while_starting()  # until RQ's handlers take over (a drain) once it listens
    import redis

    from pagedq.front.core_client import EngineDeadError
    from worker.rq.batch_worker import run_worker

    settings = _settings(args)
    try:
        run_worker(settings)
    except EngineDeadError as exc:
        raise CommandError(f"the engine died ({exc}); its jobs went back to the queue") from None
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise CommandError(f"cannot reach Redis at {settings.redis_url}: {exc}") from None
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from pagedq.local_service import LocalService, StartupFailed, default_model
    from pagedq.model_info import check_model_dir

    settings = _settings(args)
    if args.workers < 1:
        raise CommandError("--workers must be at least 1")
    if not settings.model:
        settings = settings.with_overrides(model=str(default_model(settings.cache_dir, settings.dtype)))
    try:
        check_model_dir(settings.model)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    stop_requested = False

    def request_stop(signum, frame) -> None:
        nonlocal stop_requested
        stop_requested = True

    # SIGHUP: the terminal closed; the children (in their own sessions) would outlive us.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, request_stop)
    service = LocalService(settings, workers=args.workers)
    try:
        service.start(stopping=lambda: stop_requested)
        if stop_requested:
            return 0
        _print_up(service)
        while not stop_requested:
            service.check_children()
            time.sleep(0.2)
        return 0
    except StartupFailed as exc:
        raise CommandError(str(exc)) from None
    finally:
        service.stop()


def _print_up(service) -> None:
    settings = service.settings
    base_url = settings.base_url
    redis_origin = "started by pagedq up" if service.redis_server is not None else "given"
    lines = [
        f"pagedq is up: {base_url}  (docs: {base_url}/docs; Ctrl-C stops)",
        f"  model: {settings.model_id}  ({settings.model})",
        f"  redis: {settings.redis_url}  ({redis_origin}; `rq info --url {settings.redis_url}` shows the queues)",
    ]
    if service.metrics_ports:
        lines.append("  worker metrics: " + ", ".join(f"http://{settings.host}:{port}/metrics" for port in service.metrics_ports))
    print("\n".join(lines), flush=True)


# ---- client -------------------------------------------------------------------------


@contextmanager
def connect(args: argparse.Namespace) -> Iterator[Client]:
    """A Client for the command's URL/key; its errors become CommandErrors (clean message, exit 1)."""
    import httpx

    from pagedq.client import Client, ClientError

    settings = _settings(args)
    api_key = settings.api_key.get_secret_value() if settings.api_key else None
    try:
        with Client(settings.base_url, api_key=api_key) as client:
            yield client
    except ClientError as exc:
        raise CommandError(exc.message if exc.status == 0 else str(exc)) from None
    except httpx.InvalidURL as exc:
        raise CommandError(f"--url {settings.base_url}: {exc}") from None


def cmd_submit(args: argparse.Namespace) -> int:
    sampling = given_fields(args, (*SAMPLING_FIELDS, "top_k", "priority"))
    with connect(args) as client:
        prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
        # Waiting for the whole result, it says nobody follows the stream: the job's partial
        # result is then written now and then, not every engine step.
        polls = args.wait and not args.stream
        seq_id = client.submit(**prompt, idempotency_key=args.idempotency_key, stream=not polls, **sampling)["seq_id"]
        if args.stream:
            for delta in client.stream(seq_id):
                print(delta, end="", flush=True)
            print()
            return 0
        if not args.wait:
            print(json.dumps({"seq_id": seq_id}) if args.json else seq_id)
            return 0
        result = client.wait(seq_id)
    print(json.dumps(result, indent=2) if args.json else result["text"])
    if result["status"] != "finished":
        raise CommandError(f"job {seq_id} {result['status']}: {result.get('error') or 'no result'}")
    return 0


def cmd_result(args: argparse.Namespace) -> int:
    with connect(args) as client:
        print(json.dumps(client.result(args.seq_id, wait=args.wait), indent=2))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with connect(args) as client:
        print(json.dumps(client.cancel(args.seq_id), indent=2))
    return 0
