"""`pagedq bench cpu-kernels`: the CPU engine's C++ kernels (kernels.cpu_extension) timed on
this machine, each beside what it replaces: paged-attention decodes (checked against the
reference first) with the KV bytes they read per second, and the decoder's fused
elementwise ops against the PyTorch ops in worker.models. Fastest of --repeats calls,
torch threads as given (one by default: each kernel's own cost, not a busy sibling's).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

from pagedq.bench.kernels import AttentionShape, random_paged_batch
from pagedq.bench.workload import positive_ints
from pagedq.cli import CommandError

# The engine issue's and this project's CPU checkpoints: bench-56m and SmolLM2-135M.
CPU_SHAPES = {
    "bench-56m": (AttentionShape(num_heads=8, num_kv_heads=4, head_dim=64), 512, 1408),
    "smollm2-135m": (AttentionShape(num_heads=9, num_kv_heads=3, head_dim=64), 576, 1536),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=sorted(CPU_SHAPES), default=list(CPU_SHAPES), help="model shapes to time")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"],
                        help="activation and cache dtypes to time (default: both)")
    parser.add_argument("--batch-sizes", type=positive_ints, default=[4, 32, 64], help="decoding sequences, comma-separated (default 4,32,64)")
    parser.add_argument("--context", type=int, default=512, help="keys per decoding sequence (default 512)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--repeats", type=int, default=20, help="calls per timing; the fastest counts (default 20)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def fastest_us(call: Callable[[], object], repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def run(args: argparse.Namespace) -> int:
    import torch

    from kernels import cpu_extension

    if args.context < 1 or args.repeats < 1 or args.threads < 1:
        raise CommandError("--context, --repeats and --threads must be >= 1", exit_code=2)
    if not cpu_extension.load():
        raise CommandError("the C++ CPU kernels could not be built here (see the warning above)")
    torch.set_num_threads(args.threads)
    results = {"threads": args.threads, "attention": [], "elementwise": []}
    for model in args.models:
        shape, hidden, intermediate = CPU_SHAPES[model]
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            results["attention"] += [time_decode(model, shape, batch, args.context, dtype, args.repeats) for batch in args.batch_sizes]
            results["elementwise"] += time_elementwise(model, shape, hidden, intermediate, max(args.batch_sizes), dtype, args.repeats)
    return report(results, args.json)


def time_decode(model: str, shape: AttentionShape, batch_size: int, context: int, dtype, repeats: int) -> dict:
    import torch

    from kernels.cpu_attention import paged_attention_cpu
    from kernels.reference import paged_attention_reference

    batch = random_paged_batch([1] * batch_size, [context] * batch_size, shape, dtype=dtype)
    out = torch.empty_like(batch.query)
    us = fastest_us(lambda: paged_attention_cpu(*batch.attention_args(), out=out), repeats)
    error = float((out.float() - paged_attention_reference(*batch.attention_args()).float()).abs().max())
    kv_bytes = 2 * batch_size * context * shape.num_kv_heads * shape.head_dim * batch.key_cache.element_size()
    return {"model": model, "dtype": str(dtype).removeprefix("torch."), "batch": batch_size, "context": context,
            "us": us, "kv_gbs": kv_bytes / us / 1e3, "max_abs_error": error}


def time_elementwise(model: str, shape: AttentionShape, hidden: int, intermediate: int, tokens: int, dtype, repeats: int) -> list[dict]:
    """Each fused op and the PyTorch ops it replaces, on one decode step's activations."""
    import torch
    import torch.nn.functional as F

    from kernels import cpu_elementwise
    from worker.models.layers import RMSNorm
    from worker.models.rotary import RotaryEmbedding, apply_rotary

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
    x, residual = (torch.randn(tokens, hidden, generator=gen).to(dtype) for _ in range(2))
    rotary = RotaryEmbedding(shape.head_dim, 4096, {"rope_theta": 10000.0, "rope_type": "default"}).to(dtype)
    rotary.init_buffers()
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    q = torch.randn(tokens, shape.num_heads, shape.head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype)
    gate_up = torch.randn(tokens, 2 * intermediate, generator=gen).to(dtype)

    def pytorch_rotary():
        cos, sin = rotary(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def pytorch_silu_and_mul():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    pairs = {
        "add + rms_norm": (lambda: cpu_elementwise.fused_add_rms_norm_cpu(x.clone(), residual.clone(), norm.weight, norm.eps),
                           lambda: (x.clone(), norm._norm(x.clone() + residual))),
        "rotary q, k": (lambda: cpu_elementwise.rotary_embedding_cpu(q.clone(), k.clone(), rotary.cos, rotary.sin, positions),
                        lambda: (q.clone(), k.clone(), pytorch_rotary())),
        "silu_and_mul": (lambda: cpu_elementwise.silu_and_mul_cpu(gate_up), pytorch_silu_and_mul),
    }
    return [{"model": model, "dtype": str(dtype).removeprefix("torch."), "op": op, "tokens": tokens,
             "fused_us": fastest_us(fused, repeats), "pytorch_us": fastest_us(plain, repeats)}
            for op, (fused, plain) in pairs.items()]


def report(results: dict, json_path: str | None) -> int:
    from pagedq.bench.report import format_table, load_average

    print(f"torch threads: {results['threads']}; load average {load_average()}")
    print("paged attention, decodes (one new token each over `context` keys):")
    print(format_table(["model", "dtype", "batch", "context", "us", "KV GB/s", "max abs error"],
                       [[a["model"], a["dtype"], str(a["batch"]), str(a["context"]), f"{a['us']:.1f}", f"{a['kv_gbs']:.1f}",
                         f"{a['max_abs_error']:.1e}"] for a in results["attention"]]))
    print("fused elementwise ops vs the PyTorch ops they replace (copies of the inputs included in both):")
    print(format_table(["model", "dtype", "op", "tokens", "fused us", "pytorch us", "pytorch / fused"],
                       [[e["model"], e["dtype"], e["op"], str(e["tokens"]), f"{e['fused_us']:.1f}", f"{e['pytorch_us']:.1f}",
                         f"{e['pytorch_us'] / e['fused_us']:.1f}x"] for e in results["elementwise"]]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0


__all__ = ["add_arguments", "run"]
