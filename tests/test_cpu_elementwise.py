"""The CPU engine's fused elementwise kernels (kernels.cpu_elementwise) against the PyTorch
code they replace in worker.models, on fresh random inputs: the same roundings in the same
places, so bfloat16 results are (all but) identical and float32 ones agree to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_elementwise, cpu_extension
from worker.models.layers import RMSNorm
from worker.models.rotary import RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    assert cpu_extension.load(), "the C++ CPU kernels did not build; see the warning logged above"


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: equal to rounding; half types: within two units in the last place (a last-bit
    difference before a rounding step can become one after it), and almost every element
    identical (a kernel rounding at other points than PyTorch differs in about a quarter)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        return
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1.6e-2)
    assert (got == want).float().mean() > 0.99


def random(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def norm_layer(dim: int, dtype: torch.dtype) -> RMSNorm:
    layer = RMSNorm(dim, eps=1e-6).to(dtype)
    layer.weight.data = random(dim, dtype, seed=dim) + 1
    return layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 576, 100])  # 100: a tail past the last 16 lanes
def test_rms_norm_matches_pytorch(dtype, dim):
    layer, x = norm_layer(dim, dtype), random((37, dim), dtype, seed=1) * 3
    assert_matches(cpu_elementwise.rms_norm_cpu(x, layer.weight, layer.eps), layer._norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 100])
def test_fused_add_rms_norm_is_the_sum_then_its_norm(dtype, dim):
    layer, x, residual = norm_layer(dim, dtype), random((19, dim), dtype, seed=2), random((19, dim), dtype, seed=3)
    want_residual = x + residual
    want = layer._norm(want_residual)
    cpu_elementwise.fused_add_rms_norm_cpu(x, residual, layer.weight, layer.eps)
    assert torch.equal(residual, want_residual)  # the add rounds exactly as PyTorch's
    assert_matches(x, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: a half of 20, past the 16 lanes
def test_rotary_in_place_on_strided_views_equals_pytorch(dtype, head_dim):
    table = RotaryEmbedding(head_dim, 512, {"rope_theta": 10000.0, "rope_type": "default"}).to(dtype)
    table.init_buffers()
    # q and k as the decoder passes them: views into one fused projection's output.
    qkv = random((23, (6 + 2 + 2) * head_dim), dtype, seed=4)
    q, k = qkv[:, : 6 * head_dim].view(23, 6, head_dim), qkv[:, 6 * head_dim : 8 * head_dim].view(23, 2, head_dim)
    positions = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(5))
    cos, sin = table(positions)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = qkv[:, 8 * head_dim :].clone()
    cpu_elementwise.rotary_embedding_cpu(q, k, table.cos, table.sin, positions)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # no reduction: bit for bit
    assert torch.equal(qkv[:, 8 * head_dim :], v_before)  # v, beside them, untouched


def test_rotary_refuses_a_position_outside_its_table():
    table = RotaryEmbedding(64, 16, {"rope_theta": 10000.0, "rope_type": "default"})
    table.init_buffers()
    q, k = torch.zeros(1, 2, 64), torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="outside the table"):
        cpu_elementwise.rotary_embedding_cpu(q, k, table.cos, table.sin, torch.tensor([16]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1408, 40])
def test_silu_and_mul_matches_pytorch(dtype, size):
    x = random((29, 2 * size), dtype, seed=6) * 4  # gates far into both tails of the sigmoid
    gate, up = x.chunk(2, dim=-1)
    assert_matches(cpu_elementwise.silu_and_mul_cpu(x), F.silu(gate) * up)
