"""The CPU's oneDNN linear (worker.models.layers.linear with a packed weight) against
F.linear, on row counts that are padded and ones that are not; the row buckets that
bound how many kernels oneDNN builds; and the engine building them before it serves."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from worker.models.layers import build_kernels_ahead, linear, pack_for_cpu, padded_row_counts, padded_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 32, 33, 65, 129, 300])
def test_packed_linear_matches_f_linear(rows, dtype):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 48, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    packed = pack_for_cpu(weight)
    if packed is None:
        pytest.skip("oneDNN does not serve this dtype here (bfloat16 needs AVX-512 or AVX-NE-CONVERT)")
    x = torch.randn(rows, 48, generator=generator).to(dtype)
    out = linear(x, weight, bias, packed)
    assert out.shape == (rows, 96) and out.dtype == dtype
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float(), bias.float()), atol=tolerance, rtol=tolerance)


def test_row_buckets_are_few_and_waste_little():
    buckets = [padded_rows(rows) for rows in range(1, 8193)]
    assert all(padded >= rows for rows, padded in enumerate(buckets, start=1))
    assert buckets[:32] == list(range(1, 33))  # small products cost by the row: never padded
    assert max((padded - rows) / rows for rows, padded in enumerate(buckets, start=1)) <= 1 / 16
    assert buckets == sorted(buckets)
    # Five linear shapes a model (qkv, o, gate_up, down, lm_head) within oneDNN's cache of 1,024 kernels.
    assert 5 * len(set(buckets)) <= 1024
    assert padded_rows(0) == 0


def test_padded_row_counts_are_the_buckets_of_every_row_count():
    assert padded_row_counts(40) == list(range(1, 33)) + [34, 36, 38, 40]
    assert padded_row_counts(2048) == sorted({padded_rows(rows) for rows in range(1, 2049)})


def test_kernels_are_built_ahead_only_where_a_product_is_cheap():
    small = torch.randn(96, 48)
    assert build_kernels_ahead(small, None, pack_for_cpu(small), 300) == len(padded_row_counts(300))
    # 4096 x 4096: one row is 16.8M multiply-adds, already as dear as building its kernel.
    large = torch.randn(4096, 4096)
    assert build_kernels_ahead(large, None, pack_for_cpu(large), 300) == 1


_SERVE_AFTER_START = """
import sys
from pagedq import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", max_num_seqs=8, max_num_batched_tokens=64)
print("SERVING", flush=True)
prompts = [{"prompt_token_ids": list(range(3, 3 + length))} for length in (5, 9, 17, 30)]
llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 4, 6, 8)], use_tqdm=False)
"""


def test_the_engine_builds_its_linear_kernels_before_it_serves(tiny_model_dir):
    """oneDNN reports each kernel it builds (ONEDNN_VERBOSE, on stdout): an engine's steps,
    prefill and decode, at row counts from 1 to its token budget, build none once it has
    started."""
    if pack_for_cpu(torch.randn(8, 8)) is None:
        pytest.skip("oneDNN does not serve linears here")
    env = {**os.environ, "ONEDNN_VERBOSE": "all", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", _SERVE_AFTER_START, str(tiny_model_dir())],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    starting, marker, serving = run.stdout.partition("SERVING\n")
    assert marker
    built = "create:cache_miss,cpu,inner_product"
    assert starting.count(built) >= 64  # every count up to the budget, reported
    assert serving.count("exec,cpu,inner_product") > 0  # the steps' linears, reported
    assert serving.count(built) == 0
