"""The CPU engine's attention (fused SDPA over gathered blocks, decodes grouped by context
length) against the plain reference, on fresh random paged batches."""

from __future__ import annotations

import pytest
import torch

import dataclasses

from kernels.reference import FP8_DTYPE, paged_attention_reference, to_cache
from kernels.torch_attention import paged_attention_torch
from pagedq.bench.kernels import AttentionShape, random_paged_batch

# Cache rows no sequence owns hold this, so reading outside a sequence's keys shows.
UNUSED = 50.0

CASES = {
    "decodes at block edges and over many blocks": ([1] * 7, [1, 15, 16, 17, 64, 300, 999]),
    "prefill, chunk after cached prefix, decodes": ([7, 1, 20, 1, 3, 1], [7, 33, 36, 16, 19, 250]),
    "decodes of wildly different lengths": ([1] * 9, [400, 3, 390, 5, 380, 7, 2, 201, 199]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(1, 64, 16), (2, 128, 16), (7, 64, 32)])
def test_matches_reference(case, group, head_dim, block_size):
    q_lens, seq_lens = CASES[case]
    shape = AttentionShape(num_heads=2 * group, num_kv_heads=2, head_dim=head_dim)
    batch = random_paged_batch(q_lens, seq_lens, shape, block_size=block_size, unused_value=UNUSED, seed=group)
    got = paged_attention_torch(*batch.attention_args(), out=torch.full_like(batch.query, float("nan")))
    torch.testing.assert_close(got, paged_attention_reference(*batch.attention_args()), atol=2e-5, rtol=1e-5)


def test_lane_without_context_outputs_zeros():
    batch = random_paged_batch([1, 1, 1], [5, 1, 9], AttentionShape(4, 2, 64), unused_value=UNUSED)
    batch.seq_lens[1] = 0
    got = paged_attention_torch(*batch.attention_args())
    want = paged_attention_reference(*batch.attention_args())
    assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.equal(want[1], torch.zeros_like(want[1]))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_fp8_cache_matches_reference():
    batch = random_paged_batch(*CASES["prefill, chunk after cached prefix, decodes"], AttentionShape(4, 2, 64), unused_value=UNUSED)
    quantized = dataclasses.replace(
        batch, key_cache=to_cache(batch.key_cache, FP8_DTYPE, 0.5), value_cache=to_cache(batch.value_cache, FP8_DTYPE, 2.0)
    )
    scales = dict(k_scale=0.5, v_scale=2.0)
    got = paged_attention_torch(*quantized.attention_args(), **scales)
    torch.testing.assert_close(got, paged_attention_reference(*quantized.attention_args(), **scales), atol=2e-5, rtol=1e-5)
    # Quantization changed the result, but only by e4m3's rounding.
    exact = paged_attention_reference(*batch.attention_args())
    assert not torch.equal(got, exact)
    torch.testing.assert_close(got, exact, atol=0.15, rtol=0.1)
