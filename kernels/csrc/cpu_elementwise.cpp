// The per-layer elementwise work of a Llama-style decoder in one pass each, for the CPU
// engine: RMSNorm (with the residual add folded in), rotary embedding of q and k in place,
// and SiLU(gate) * up. Each replaces a chain of 4-10 PyTorch ops whose dispatch, not
// arithmetic, took the time at decode sizes.
//
// Same roundings as the PyTorch code they replace (worker/models/layers.py and rotary.py,
// which mirror transformers): every intermediate that PyTorch materialises in the model
// dtype is rounded to it here too, so bfloat16 results are identical and float32 ones
// differ only where a sum is taken in another order (or, for SiLU, by exp's last bit).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace {

using namespace pagedq_vec;

// Rows are split among threads only when there is enough work to pay for waking them.
constexpr int64_t kElementsPerTask = 1 << 15;

inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(kElementsPerTask / std::max<int64_t>(row_elements, 1), 1); }

// y = round(round(x / rms(x)) * w): normalised in float32, cast to the model dtype, scaled by the weight.
template <typename T>
inline void norm_row(const T* x, const T* w, T* y, int64_t D, float eps) {
  vf squares = {};
  for (int64_t d = 0; d < D; d += kLanes) {
    const vf v = load_float_n(x + d, std::min(kLanes, D - d));
    squares += v * v;
  }
  const float inv_rms = 1.f / std::sqrt(hsum(squares) / static_cast<float>(D) + eps);
  for (int64_t d = 0; d < D; d += kLanes) {
    const int64_t n = std::min(kLanes, D - d);
    store_as_n(y + d, round_to<T>(load_float_n(x + d, n) * inv_rms) * load_float_n(w + d, n), n);
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              op, ": x [rows, D] contiguous, weight [D] of x's dtype");
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  check_rows(x, weight, "rms_norm");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "rms_norm: out must be like x");
  const int64_t rows = x.size(0), D = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(D), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(in + r * D, w, y + r * D, D, static_cast<float>(eps));
    });
  });
}

// residual += x (rounded as PyTorch's add), then x = rms_norm(residual) * weight: the
// residual stream and the next sublayer's input in one pass.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual must be like x");
  const int64_t rows = x.size(0), D = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(D), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* res_row = res + r * D;
        const scalar_t* in_row = in + r * D;
        for (int64_t d = 0; d < D; d += kLanes) {
          const int64_t n = std::min(kLanes, D - d);
          store_as_n(res_row + d, load_float_n(res_row + d, n) + load_float_n(in_row + d, n), n);
        }
        norm_row(res + r * D, w, in + r * D, D, static_cast<float>(eps));
      }
    });
  });
}

// One head's row rotated by the half-split (GPT-NeoX / Hugging Face) convention:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product and sum rounded to T.
template <typename T>
inline void rotate_row(T* row, const T* cos, const T* sin, int64_t half) {
  for (int64_t i = 0; i < half; i += kLanes) {
    const int64_t n = std::min(kLanes, half - i);
    const vf x1 = load_float_n(row + i, n), x2 = load_float_n(row + i + half, n);
    const vf c = load_float_n(cos + i, n), s = load_float_n(sin + i, n);
    store_as_n(row + i, materialized(round_to<T>(x1 * c)) - materialized(round_to<T>(x2 * s)), n);
    store_as_n(row + i + half, materialized(round_to<T>(x2 * c)) + materialized(round_to<T>(x1 * s)), n);
  }
}

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.stride(2) == 1,
              "rotary_embedding: ", name, " must be [tokens, heads, head_dim] on the CPU with contiguous rows");
}

// q [T, H, D] and k [T, KH, D] (views into the qkv projection's output are fine: rows
// need only be contiguous) rotated in place by the rows of the cos / sin tables
// [max_positions, D / 2] at `positions` [T].
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions) {
  check_heads(q, "q");
  check_heads(k, "k");
  const int64_t tokens = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == D && D % 2 == 0, "rotary_embedding: q and k must share tokens and an even head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(1) == half && cos.scalar_type() == q.scalar_type() && k.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "rotary_embedding: cos and sin [max_positions, head_dim / 2] of q's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == tokens,
              "rotary_embedding: positions int64 [tokens]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_positions = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions, "rotary_embedding: position ", pos[t], " outside the table of ", max_positions);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const int64_t heads = q.size(1), kv_heads = k.size(1);
    at::parallel_for(0, tokens, grain_rows((heads + kv_heads) * D), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* ct = c + pos[t] * half;
        const scalar_t* st = s + pos[t] * half;
        for (int64_t h = 0; h < heads; ++h) rotate_row(qp + t * q.stride(0) + h * q.stride(1), ct, st, half);
        for (int64_t h = 0; h < kv_heads; ++h) rotate_row(kp + t * k.stride(0) + h * k.stride(1), ct, st, half);
      }
    });
  });
}

// out [T, I] = silu(x[:, :I]) * x[:, I:], silu rounded to the dtype first as PyTorch's
// `F.silu(gate) * up` does.
void silu_and_mul(const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: x [tokens, 2 * I] contiguous on the CPU");
  const int64_t rows = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == I && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(),
              "silu_and_mul: out [tokens, I] of x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * 2 * I;
        const scalar_t* up = gate + I;
        scalar_t* out_row = y + r * I;
        for (int64_t i = 0; i < I; i += kLanes) {
          const int64_t n = std::min(kLanes, I - i);
          const vf g = load_float_n(gate + i, n);
          // silu(g) = g / (1 + e^-g), from e = e^-|g| (which cannot overflow): g / (1 + e)
          // for g >= 0, g e / (1 + e) below.
          const vf e = exp_nonpositive(g < 0 ? g : -g);
          const vf silu = (g < 0 ? g * e : g) * reciprocal(1.f + e);
          store_as_n(out_row + i, round_to<scalar_t>(silu) * load_float_n(up + i, n), n);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedq_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor positions) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("fused_add_rms_norm", fused_add_rms_norm);
  m.impl("rotary_embedding", rotary_embedding);
  m.impl("silu_and_mul", silu_and_mul);
}
