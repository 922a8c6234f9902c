"""The CPU's oneDNN linear (worker.models.layers.linear with a packed weight) against
F.linear, on row counts that are padded and ones that are not; and the row buckets that
bound how many kernels oneDNN builds."""

import pytest
import torch
import torch.nn.functional as F

from worker.models.layers import linear, pack_for_cpu, padded_rows


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
