"""The CPU engine's attention against the plain reference, on fresh random paged batches:
the C++ kernel that reads the cache in place (kernels.cpu_attention, built here at first
use) and its pure-PyTorch fallback (fused SDPA over gathered blocks)."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import get_attention_backend
from kernels import cpu_extension
from kernels.cpu_attention import paged_attention_cpu, store_kv_cpu
from kernels.reference import FP8_DTYPE, paged_attention_reference, store_kv_reference, to_cache
from kernels.torch_attention import paged_attention_torch
from pagedq.bench.kernels import AttentionShape, random_paged_batch


@pytest.fixture(scope="module", autouse=True)
def built_kernel():
    # The C++ kernel must build wherever the suite runs (a compiler is part of the test setup).
    assert cpu_extension.load(), "the C++ CPU kernels did not build; see the warning logged above"


IMPLEMENTATIONS = {"cpu": paged_attention_cpu, "torch": paged_attention_torch}

# Cache rows no sequence owns hold this, so reading outside a sequence's keys shows.
UNUSED = 50.0

CASES = {
    "decodes at block edges and over many blocks": ([1] * 7, [1, 15, 16, 17, 64, 300, 999]),
    "prefill, chunk after cached prefix, decodes": ([7, 1, 20, 1, 3, 1], [7, 33, 36, 16, 19, 250]),
    "decodes of wildly different lengths": ([1] * 9, [400, 3, 390, 5, 380, 7, 2, 201, 199]),
}


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(1, 64, 16), (2, 128, 16), (7, 64, 32), (3, 16, 16), (2, 40, 8)])
def test_matches_reference(impl, case, group, head_dim, block_size):
    # head_dim 64 and 128 take the kernel's register paths, 16 and 40 its generic one.
    q_lens, seq_lens = CASES[case]
    shape = AttentionShape(num_heads=2 * group, num_kv_heads=2, head_dim=head_dim)
    batch = random_paged_batch(q_lens, seq_lens, shape, block_size=block_size, unused_value=UNUSED, seed=group)
    got = IMPLEMENTATIONS[impl](*batch.attention_args(), out=torch.full_like(batch.query, float("nan")))
    torch.testing.assert_close(got, paged_attention_reference(*batch.attention_args()), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(3, 64, 16), (2, 128, 32), (2, 40, 8)])
def test_half_precision_matches_reference(dtype, case, group, head_dim, block_size):
    # bfloat16 with head_dim 64 and 128 takes the kernel's bfloat16 dot products and split
    # value rows (where the CPU has AVX512-BF16); 40 the generic path.
    shape = AttentionShape(num_heads=2 * group, num_kv_heads=2, head_dim=head_dim)
    batch = random_paged_batch(*CASES[case], shape, block_size=block_size, dtype=dtype, unused_value=UNUSED, seed=head_dim)
    got = paged_attention_cpu(*batch.attention_args())
    assert got.dtype == dtype
    torch.testing.assert_close(got, paged_attention_reference(*batch.attention_args()), atol=1.5e-2, rtol=1e-2)


@pytest.mark.parametrize("threads", [1, 3])
def test_result_does_not_depend_on_threads(threads):
    batch = random_paged_batch([40, 1, 1, 17, 1], [40, 300, 2, 90, 64], AttentionShape(4, 2, 64), unused_value=UNUSED)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = paged_attention_cpu(*batch.attention_args())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, paged_attention_cpu(*batch.attention_args()))


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
def test_lane_without_context_outputs_zeros(impl):
    batch = random_paged_batch([1, 1, 1], [5, 1, 9], AttentionShape(4, 2, 64), unused_value=UNUSED)
    batch.seq_lens[1] = 0
    got = IMPLEMENTATIONS[impl](*batch.attention_args(), out=torch.full_like(batch.query, float("nan")))
    want = paged_attention_reference(*batch.attention_args())
    assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.equal(want[1], torch.zeros_like(want[1]))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
def test_fp8_cache_matches_reference(impl):
    batch = random_paged_batch(*CASES["prefill, chunk after cached prefix, decodes"], AttentionShape(4, 2, 64), unused_value=UNUSED)
    quantized = dataclasses.replace(
        batch, key_cache=to_cache(batch.key_cache, FP8_DTYPE, 0.5), value_cache=to_cache(batch.value_cache, FP8_DTYPE, 2.0)
    )
    scales = dict(k_scale=0.5, v_scale=2.0)
    got = IMPLEMENTATIONS[impl](*quantized.attention_args(), **scales)
    torch.testing.assert_close(got, paged_attention_reference(*quantized.attention_args(), **scales), atol=2e-5, rtol=1e-5)
    # Quantization changed the result, but only by e4m3's rounding.
    exact = paged_attention_reference(*batch.attention_args())
    assert not torch.equal(got, exact)
    torch.testing.assert_close(got, exact, atol=0.15, rtol=0.1)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_store_kv_matches_reference(cache_dtype):
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    # Keys and values as the models pass them: strided views into one fused projection.
    fused = torch.randn(20, 3, 2, 64, generator=gen).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(10 * 16, generator=gen)[:20]
    slots[[3, 11]] = -1  # padding: never stored
    caches = [torch.full((10, 16, 2, 64), UNUSED).to(cache_dtype) for _ in range(4)]
    store_kv_reference(key, value, caches[0], caches[1], slots, 0.5, 2.0)
    store_kv_cpu(key, value, caches[2], caches[3], slots, 0.5, 2.0)
    assert torch.equal(caches[0].float(), caches[2].float()) and torch.equal(caches[1].float(), caches[3].float())


def test_backends_cpu_by_default():
    assert get_attention_backend("auto", "cpu").name == "cpu"
    assert get_attention_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="CPU only"):
        get_attention_backend("cpu", "cuda")


def test_falls_back_to_pytorch_where_the_kernel_cannot_build(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this machine cannot build the kernel\n")
    monkeypatch.setattr(cpu_extension, "SOURCES", (broken,))
    cpu_extension.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kernels.cpu_extension"):
            assert get_attention_backend("auto", "cpu").name == "torch"
        assert "kernels are unavailable" in caplog.text
        monkeypatch.undo()
        cpu_extension.load.cache_clear()
        monkeypatch.setenv("PAGEDQ_CPU_KERNEL", "0")
        assert get_attention_backend("auto", "cpu").name == "torch"
    finally:
        cpu_extension.load.cache_clear()


def test_a_build_killed_midway_does_not_stall_the_next_load(tmp_path):
    """torch's build lock (a `lock` file) is left behind by a process killed while it builds
    the kernels (a worker stopped while its engine loads), and torch waits for it to go away
    forever: every later engine start hung. Loading past a leftover lock, here in a copy of
    this session's build, succeeds and removes it."""
    from torch.utils.cpp_extension import _get_build_directory

    assert cpu_extension.load()
    name = cpu_extension.build_name()
    build = tmp_path / name
    shutil.copytree(_get_build_directory(name, verbose=False), build)  # built: loading it compiles nothing
    (build / "lock").touch()
    loaded = subprocess.run([sys.executable, "-c", "from kernels import cpu_extension; assert cpu_extension.load()"],
                            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}, cwd=Path(__file__).parents[1],
                            capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert not (build / "lock").exists()


def test_the_kernel_is_built_with_openmp():
    """at::parallel_for is compiled into the extension: built without OpenMP it is a serial
    loop, and attention then ran on one thread whatever torch's thread count (it did, until
    -fopenmp). Built with it, the library calls libgomp's GOMP_parallel."""
    assert cpu_extension.load()
    (library,) = [p for p in torch.ops.loaded_libraries if cpu_extension.build_name() in p]
    assert b"GOMP_parallel" in Path(library).read_bytes()
