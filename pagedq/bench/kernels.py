"""`pagedq bench kernels`: the Triton paged-attention and KV-store kernels, first checked
against the PyTorch reference, then timed against PyTorch SDPA (and `varlen_attn` where
present) on the same data laid out contiguously.

Needs a CUDA GPU; `--interpret` runs only a tiny correctness check on CPU through the
Triton interpreter. torch and triton are imported inside functions so that building the
CLI stays cheap (and so that `--interpret` can switch the interpreter on before triton
is first imported).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Callable

from pagedq.bench.workload import positive_ints
from pagedq.cli import CommandError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int


MODEL_SHAPES = {
    "qwen2.5-0.5b": AttentionShape(num_heads=14, num_kv_heads=2, head_dim=64),
    "llama-3.2-1b": AttentionShape(num_heads=32, num_kv_heads=8, head_dim=64),
}
INTERPRETER_SHAPE = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=64)
DTYPES = ("bfloat16", "float16", "float32")
TOLERANCE = {"float32": (2e-5, 1e-5), "float16": (1e-2, 1e-2), "bfloat16": (1.5e-2, 1e-2)}  # (atol, rtol)
# Correctness batch: full prefill, decodes at block edges and over long contexts, a
# chunk after a cached prefix, a single-token context.
CHECK_Q_LENS = [37, 1, 1, 64, 1, 1]
CHECK_SEQ_LENS = [37, 16, 17, 300, 1000, 1]


@dataclass
class PagedBatch:
    """A packed batch whose keys and values sit in a paged cache behind shuffled block tables."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    max_query_len: int
    max_seq_len: int
    scale: float

    def attention_args(self) -> tuple:
        """Positional arguments of `paged_attention_*` (without `out`)."""
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
            self.max_query_len,
            self.max_seq_len,
        )

    def contiguous_kv(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``seq``'s keys and values gathered out of the cache: [seq_len, kv_heads, head_dim]."""
        seq_len = int(self.seq_lens[seq])
        block_size = self.key_cache.shape[1]
        blocks = self.block_tables[seq, : -(-seq_len // block_size)].long()
        return tuple(cache[blocks].flatten(0, 1)[:seq_len] for cache in (self.key_cache, self.value_cache))


def random_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    shape: AttentionShape,
    *,
    block_size: int = 16,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    unused_value: float = 0.0,
) -> PagedBatch:
    """Random queries and K/V; each sequence's blocks are drawn from a shuffled pool.

    Cache rows no sequence owns (and block-table padding, which points at a spare block)
    hold `unused_value`: a large one makes any read outside a sequence's keys visible.
    """
    import torch

    dtype = dtype or torch.float32
    if len(q_lens) != len(seq_lens) or any(not 1 <= q <= s for q, s in zip(q_lens, seq_lens)):
        raise ValueError(f"need 1 <= q_len <= seq_len per sequence, got q_lens={q_lens} seq_lens={seq_lens}")
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1  # the last block of the shuffled pool stays spare
    pool = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    spare = pool[-1:]
    owned = pool[:-1].split(blocks_per_seq)
    width = max(blocks_per_seq) + 1  # tables wider than any sequence, as in the engine
    block_tables = torch.stack([torch.cat([blocks, spare.expand(width - len(blocks))]) for blocks in owned])

    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.full(cache_shape, unused_value, dtype=dtype, device=device)
    value_cache = torch.full(cache_shape, unused_value, dtype=dtype, device=device)
    slots = torch.cat(
        [blocks.long().repeat_interleave(block_size)[:n] * block_size + torch.arange(n, device=device) % block_size for blocks, n in zip(owned, seq_lens)]
    )
    kv_shape = (len(slots), shape.num_kv_heads, shape.head_dim)
    key_cache.view(-1, *kv_shape[1:])[slots] = torch.randn(kv_shape, generator=gen, device=device).to(dtype)
    value_cache.view(-1, *kv_shape[1:])[slots] = torch.randn(kv_shape, generator=gen, device=device).to(dtype)
    query = torch.randn(sum(q_lens), shape.num_heads, shape.head_dim, generator=gen, device=device).to(dtype)
    return PagedBatch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        query_start_loc=torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        scale=shape.head_dim**-0.5,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=sorted(MODEL_SHAPES), default=list(MODEL_SHAPES), help="attention shapes to time")
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1, 32, 256], help="decode batch sizes, comma-separated (default 1,32,256)")
    parser.add_argument("--context", type=int, default=1024, help="decode context length per sequence (default 1024)")
    parser.add_argument("--prefill-batch-sizes", type=positive_ints, default=[1, 8], help="prefill batch sizes (default 1,8)")
    parser.add_argument("--prompt-len", type=int, default=1024, help="prefill prompt length (default 1024)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the tensors' dtype (default bfloat16)")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (default 16)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--interpret", action="store_true", help="no GPU: only a tiny correctness check on CPU through the Triton interpreter"
    )


def run(args: argparse.Namespace) -> int:
    for name in ("context", "prompt_len", "block_size"):
        if getattr(args, name) < 1:
            raise CommandError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.interpret:
        _enable_interpreter()
        results = {"device": "cpu (Triton interpreter)", "correctness": check_correctness("cpu", "float32", {"tiny": INTERPRETER_SHAPE}, args.block_size)}
        return _report(results, args.json)

    import torch

    if not torch.cuda.is_available():
        raise CommandError("`pagedq bench kernels` needs a CUDA GPU; use --interpret for a tiny CPU correctness check")
    import triton

    shapes = {name: MODEL_SHAPES[name] for name in args.models}
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "copy_bandwidth_gbs": measure_copy_bandwidth(),
        "correctness": check_correctness("cuda", args.dtype, shapes, args.block_size),
    }
    results["timings"] = [
        time_attention(name, shape, batch, context, args.dtype, args.block_size, decode)
        for name, shape in shapes.items()
        for decode, batches, context in ((True, args.batch_sizes, args.context), (False, args.prefill_batch_sizes, args.prompt_len))
        for batch in batches
    ]
    return _report(results, args.json)


def _enable_interpreter() -> None:
    """Triton picks compiled-or-interpreted for its own helpers at first import."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise CommandError("--interpret: triton was already imported; run with TRITON_INTERPRET=1 in the environment")
    os.environ["TRITON_INTERPRET"] = "1"


def check_correctness(device: str, dtype_name: str, shapes: dict[str, AttentionShape], block_size: int) -> list[dict]:
    """Both kernels against the reference on a batch mixing prefill, chunked prefill and decode."""
    import torch

    from kernels import get_attention_backend
    from kernels.reference import paged_attention_reference, store_kv_reference

    triton_backend = get_attention_backend("triton", device)
    dtype = getattr(torch, dtype_name)
    atol, rtol = TOLERANCE[dtype_name]
    checks = []
    for name, shape in shapes.items():
        batch = random_paged_batch(CHECK_Q_LENS, CHECK_SEQ_LENS, shape, block_size=block_size, dtype=dtype, device=device, unused_value=50.0)
        want = paged_attention_reference(*batch.attention_args())
        for splits in (1, 4, None):
            got = triton_backend.paged_attention(*batch.attention_args(), out=torch.full_like(want, float("nan")), num_splits=splits)
            checks.append(_compare(f"{name} attention, splits={splits or 'auto'}", got, want, atol, rtol))

        num_tokens = batch.query.shape[0]
        slots = torch.randperm(batch.key_cache[:, :, 0, 0].numel(), device=device)[:num_tokens]
        slots[::3] = -1  # padded lanes
        key, value = (torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype) for _ in range(2))
        got_k, got_v, want_k, want_v = (c.clone() for c in (batch.key_cache, batch.value_cache) * 2)
        triton_backend.store_kv(key, value, got_k, got_v, slots)
        store_kv_reference(key, value, want_k, want_v, slots)
        checks.append(_compare(f"{name} store_kv", torch.stack([got_k, got_v]), torch.stack([want_k, want_v]), 0.0, 0.0))
    return checks


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> dict:
    import torch

    error = (got.float() - want.float()).abs()
    ok = bool(torch.isclose(got.float(), want.float(), atol=atol, rtol=rtol).all())
    return {"check": name, "ok": ok, "max_abs_error": float(error.max())}


def measure_copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy GB/s, counting bytes read plus written: the card's practical ceiling."""
    import torch
    from triton.testing import do_bench

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * num_bytes / ms / 1e6


def time_attention(model: str, shape: AttentionShape, batch_size: int, length: int, dtype_name: str, block_size: int, decode: bool) -> dict:
    """Decode: one new token over `length` keys per sequence; prefill: `length` new tokens from scratch."""
    import torch
    from triton.testing import do_bench

    from kernels.triton_attention import paged_attention_triton

    dtype = getattr(torch, dtype_name)
    q_len = 1 if decode else length
    batch = random_paged_batch([q_len] * batch_size, [length] * batch_size, shape, block_size=block_size, dtype=dtype, device="cuda")
    out = torch.empty_like(batch.query)
    timings = {"paged_triton": do_bench(lambda: paged_attention_triton(*batch.attention_args(), out=out), return_mode="median")}
    triton_out = out.clone()

    # The same keys and values, contiguous per sequence: [batch, kv_heads, length, head_dim].
    k, v = (torch.stack(t).transpose(1, 2).contiguous() for t in zip(*(batch.contiguous_kv(s) for s in range(batch_size))))
    q = batch.query.view(batch_size, q_len, shape.num_heads, shape.head_dim).transpose(1, 2)
    sdpa = _sdpa_call(q, k, v, batch.scale, causal=not decode)
    timings["sdpa"] = do_bench(sdpa, return_mode="median")
    sdpa_out = sdpa().transpose(1, 2).reshape(batch.query.shape)
    varlen = _varlen_call(batch.query, k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1), batch, causal=not decode)
    if varlen is not None:
        timings["varlen_attn"] = do_bench(varlen, return_mode="median")

    kv_bytes = 2 * batch_size * length * shape.num_kv_heads * shape.head_dim * batch.key_cache.element_size()
    causal_pairs = batch_size * q_len * (length if decode else (length + 1) / 2)
    result = {
        "model": model,
        "phase": "decode" if decode else "prefill",
        "batch": batch_size,
        "context": length,
        "ms": timings,
        "kv_read_gbs": kv_bytes / timings["paged_triton"] / 1e6,
        "tflops": 4 * causal_pairs * shape.num_heads * shape.head_dim / timings["paged_triton"] / 1e9,
        "sdpa_time_ratio": timings["sdpa"] / timings["paged_triton"],
        "max_abs_diff_vs_sdpa": float((triton_out.float() - sdpa_out.float()).abs().max()),
    }
    return result


def _sdpa_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> Callable[[], torch.Tensor]:
    import torch.nn.functional as F

    # Decode's single query sees every key; prefill queries and keys have equal lengths,
    # so SDPA's top-left causal alignment is the right one.
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def _varlen_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PagedBatch, causal: bool) -> Callable[[], torch.Tensor] | None:
    """`torch.nn.attention.varlen.varlen_attn` over the packed contiguous K/V, if this torch has it.

    Its keyword arguments changed across releases (is_causal vs window_size, enable_gqa),
    so they are chosen from the signature; without GQA support K/V heads are repeated.
    """
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict = {"scale": batch.scale} if "scale" in params else {}
    if "is_causal" in params:
        kwargs["is_causal"] = causal
    elif causal:
        kwargs["window_size"] = (-1, 0)
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    cu_seq_k = torch.zeros_like(batch.query_start_loc)
    cu_seq_k[1:] = batch.seq_lens.cumsum(0)
    call = lambda: varlen_attn(query, key, value, batch.query_start_loc, cu_seq_k, batch.max_query_len, batch.max_seq_len, **kwargs)  # noqa: E731
    try:
        call()
    except (RuntimeError, TypeError, ValueError) as exc:
        print(f"varlen_attn skipped: {exc}", file=sys.stderr)
        return None
    return call


def _report(results: dict, json_path: str | None) -> int:
    failed = [c for c in results["correctness"] if not c["ok"]]
    print(f"device: {results['device']}")
    for check in results["correctness"]:
        print(f"  {'ok  ' if check['ok'] else 'FAIL'} {check['check']:<40} max abs error {check['max_abs_error']:.2e}")
    if "copy_bandwidth_gbs" in results:
        print(f"device-to-device copy: {results['copy_bandwidth_gbs']:.0f} GB/s (read + write)")
    if results.get("timings"):
        header = f"{'model':<14} {'phase':<8} {'batch':>5} {'ctx':>5} {'triton ms':>10} {'sdpa ms':>9} {'varlen ms':>10} {'KV GB/s':>8} {'TFLOP/s':>8} {'sdpa/triton':>11}"
        print(header)
        for t in results["timings"]:
            varlen = t["ms"].get("varlen_attn")
            print(
                f"{t['model']:<14} {t['phase']:<8} {t['batch']:>5} {t['context']:>5} {t['ms']['paged_triton']:>10.4f} "
                f"{t['ms']['sdpa']:>9.4f} {'-' if varlen is None else f'{varlen:.4f}':>10} "
                f"{t['kv_read_gbs']:>8.0f} {t['tflops']:>8.1f} {t['sdpa_time_ratio']:>11.2f}"
            )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    if failed:
        print(f"{len(failed)} correctness check(s) failed", file=sys.stderr)
        return 1
    return 0


__all__ = ["AttentionShape", "MODEL_SHAPES", "PagedBatch", "random_paged_batch", "add_arguments", "run"]
