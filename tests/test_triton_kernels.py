"""Triton paged-attention and KV-store kernels against the PyTorch reference.

Where the kernels run: Triton decides compiled-or-interpreted when each @triton.jit function
is defined, and triton.language's own helpers (tl.cdiv, ...) are defined when triton is first
imported. So TRITON_INTERPRET=1 only works if it is set before *anything* in the process
imports triton, which this module cannot guarantee inside a shared pytest process (another
test module may have imported triton first), and setting it process-wide would leak into
every other module's subprocesses. Hence:
- in a child pytest started with TRITON_INTERPRET=1 the kernel tests run on CPU tensors;
- in the parent they run on CUDA when there is a GPU, and are skipped otherwise;
- `test_kernels_under_interpreter` (parent only) starts that child and fails if it fails.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from kernels import AttentionBackend, get_attention_backend
from kernels.reference import FP8_DTYPE, from_cache, paged_attention_reference, store_kv_reference, to_cache
from pagedq.bench.kernels import AttentionShape, PagedBatch, random_paged_batch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else ("cuda" if torch.cuda.is_available() else None)
# Cache rows no sequence owns hold this: a kernel reading past a sequence's keys (or through
# the wrong block-table entry) lets them dominate its softmax and fails the comparison.
UNUSED_CACHE_VALUE = 50.0
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}

needs_kernels = pytest.mark.skipif(
    DEVICE is None, reason="no GPU: runs in a TRITON_INTERPRET=1 child (test_kernels_under_interpreter)"
)


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
def test_kernels_under_interpreter() -> None:
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert child.returncode == 0, f"interpreted kernel tests failed:\n{child.stdout[-6000:]}\n{child.stderr[-2000:]}"


@pytest.fixture(scope="module")
def triton_backend() -> AttentionBackend:
    return get_attention_backend("triton", DEVICE)


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    shape = AttentionShape(num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_dim=head_dim)
    return random_paged_batch(
        q_lens, seq_lens, shape, block_size=block_size, dtype=dtype, device=DEVICE, seed=seed, unused_value=UNUSED_CACHE_VALUE
    )


def run_triton(backend: AttentionBackend, batch: PagedBatch, num_splits: int | None = None) -> torch.Tensor:
    poisoned = torch.full_like(batch.query, float("nan"))
    result = backend.paged_attention(*batch.attention_args(), out=poisoned, num_splits=num_splits)
    assert result is poisoned
    return result


def assert_matches_reference(backend: AttentionBackend, batch: PagedBatch, num_splits: int | None = None) -> torch.Tensor:
    got = run_triton(backend, batch, num_splits)
    want = paged_attention_reference(*batch.attention_args())
    torch.testing.assert_close(got, want, **TOLERANCE[batch.query.dtype])
    return got


@needs_kernels
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (2, 128), (7, 64)])
def test_decode_over_block_boundaries(triton_backend: AttentionBackend, group: int, head_dim: int) -> None:
    contexts = [1, 15, 16, 17, 90]
    batch = make_batch([1] * len(contexts), contexts, group=group, head_dim=head_dim)
    assert_matches_reference(triton_backend, batch, num_splits=1)


# Sequences: full prefill; decode; chunk of 20 after 16 cached; decode at a block edge;
# chunk of 3 after 16 cached (query block smaller than a key tile, offset by the cache).
MIXED_Q_LENS = [7, 1, 20, 1, 3]
MIXED_SEQ_LENS = [7, 33, 36, 16, 19]


@needs_kernels
@pytest.mark.parametrize(("group", "block_size"), [(1, 16), (7, 32)])
def test_mixed_prefill_chunked_prefill_and_decode(triton_backend: AttentionBackend, group: int, block_size: int) -> None:
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_kv_heads=1, group=group, block_size=block_size)
    assert_matches_reference(triton_backend, batch, num_splits=1)


@needs_kernels
def test_split_k_matches_single_pass(triton_backend: AttentionBackend) -> None:
    # The 4-token chunk straddles a key-tile edge, so its first rows see nothing in the last
    # slice; 8 slices of a 3-token context leave most slices empty; 3 slices split 200 unevenly.
    batch = make_batch([1, 4, 1], [200, 130, 3], seed=1)
    single = assert_matches_reference(triton_backend, batch, num_splits=1)
    for splits in (3, 8):
        torch.testing.assert_close(run_triton(triton_backend, batch, num_splits=splits), single, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize(("window", "num_splits"), [(1, 1), (5, 1), (32, 1), (32, 4), (100, 2)])
def test_sliding_window_matches_reference(triton_backend: AttentionBackend, window: int, num_splits: int) -> None:
    # Decodes before, at and past the window; a 20-token chunk after 50 cached tokens that
    # straddles the window's edge (tiles wholly behind the earliest query are skipped); a
    # prefill longer than the window; a 70-token prefill over 16-token blocks.
    batch = make_batch([1, 1, 1, 20, 50, 70], [31, 32, 200, 70, 50, 70], block_size=16, seed=window)
    want = paged_attention_reference(*batch.attention_args(), sliding_window=window)
    poisoned = torch.full_like(batch.query, float("nan"))
    got = triton_backend.paged_attention(*batch.attention_args(), out=poisoned, num_splits=num_splits, sliding_window=window)
    torch.testing.assert_close(got, want, **TOLERANCE[batch.query.dtype])


@needs_kernels
def test_fp16_mixed_batch(triton_backend: AttentionBackend) -> None:
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_kv_heads=2, group=2, dtype=torch.float16, seed=2)
    assert_matches_reference(triton_backend, batch)


@needs_kernels
def test_head_dim_padded_to_power_of_two(triton_backend: AttentionBackend) -> None:
    batch = make_batch([3, 1], [19, 17], head_dim=40, seed=3)
    assert_matches_reference(triton_backend, batch)


@needs_kernels
def test_padded_lane_without_context_outputs_zeros(triton_backend: AttentionBackend) -> None:
    # CUDA-graph padding: a decode lane with seq_len 0 outputs zeros, as the reference does.
    batch = make_batch([1, 1], [5, 1], seed=4)
    batch.seq_lens[1] = 0
    for splits in (1, 4):
        out = run_triton(triton_backend, batch, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[0], paged_attention_reference(*batch.attention_args())[0])


@needs_kernels
@pytest.mark.parametrize(("key_dtype", "cache_dtype", "head_dim"), [(torch.float32, torch.float32, 64), (torch.float32, torch.float16, 40)])
def test_store_kv_writes_slots_and_skips_padding(
    triton_backend: AttentionBackend, key_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, num_kv_heads = 4, 16, 2
    slots = torch.tensor([17, -1, 0, 63, -1, 40], device=DEVICE)
    key, value = (torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE, key_dtype) for _ in range(2))
    # One guard block before the cache: a kernel that stored slot -1 would write into it.
    storage_shape = (2, num_blocks + 1, block_size, num_kv_heads, head_dim)
    storage = torch.full(storage_shape, UNUSED_CACHE_VALUE, dtype=cache_dtype, device=DEVICE)
    want = storage.clone()

    triton_backend.store_kv(key, value, storage[0, 1:], storage[1, 1:], slots)
    store_kv_reference(key, value, want[0, 1:], want[1, 1:], slots)
    assert torch.equal(storage, want)
    written = (storage[:, 1:] != UNUSED_CACHE_VALUE).any(dim=(0, 3, 4)).flatten().nonzero().flatten()
    assert written.tolist() == [0, 17, 40, 63]


@needs_kernels
def test_rejects_mismatched_head_dim(triton_backend: AttentionBackend) -> None:
    batch = make_batch([1], [4])
    with pytest.raises(ValueError, match="query"):
        triton_backend.paged_attention(batch.query[..., :32], *batch.attention_args()[1:])


@needs_kernels
def test_fp8_cache_store_and_attention(triton_backend: AttentionBackend) -> None:
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, seed=6)
    k_scale, v_scale = 0.5, 2.0
    fp8 = dict(key_cache=to_cache(batch.key_cache, FP8_DTYPE, k_scale), value_cache=to_cache(batch.value_cache, FP8_DTYPE, v_scale))
    quantized = dataclasses.replace(batch, **fp8)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    got = triton_backend.paged_attention(*quantized.attention_args(), out=torch.full_like(batch.query, float("nan")), **scales)
    torch.testing.assert_close(got, paged_attention_reference(*quantized.attention_args(), **scales), atol=2e-5, rtol=1e-5)

    slots = torch.tensor([3, -1, 40, 17], device=DEVICE)
    # Values on e4m3's grid once scaled (the interpreter's float -> e4m3 rounding drops the
    # carry at binade edges, e.g. 124 -> 64; a GPU converts in hardware), and some beyond its range.
    key, value = (
        from_cache(to_cache(torch.randn(4, 2, 64, device=DEVICE) * 100, FP8_DTYPE, 1.0), torch.float32, 1.0) * s
        for s in (k_scale, v_scale)
    )
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 300.0, -225.0]) * k_scale
    got_k, got_v, want_k, want_v = (torch.zeros(4, 16, 2, 64, dtype=FP8_DTYPE, device=DEVICE) for _ in range(4))
    triton_backend.store_kv(key, value, got_k, got_v, slots, k_scale, v_scale)
    store_kv_reference(key, value, want_k, want_v, slots, k_scale, v_scale)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    assert got_k[0, 3, 0, :4].float().tolist() == [448.0, -448.0, 288.0, -224.0]  # saturated and rounded


@needs_kernels
def test_engine_on_triton_kernels_equals_engine_on_torch(tiny_model_dir) -> None:
    """The kernels inside the whole engine: chunked prefill (a 20-token budget), decode and
    block-table growth give the same greedy tokens as the torch attention path."""
    from pagedq import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 30)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {
        backend: LLM(str(tiny_model_dir("llama")), device=DEVICE, dtype="float32", attention_backend=backend,
                     max_num_batched_tokens=20, enforce_eager=True).generate(prompts, greedy, use_tqdm=False)
        for backend in ("triton", "torch")
    }
    assert [o.outputs[0].token_ids for o in outputs["triton"]] == [o.outputs[0].token_ids for o in outputs["torch"]]
