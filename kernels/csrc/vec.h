// Vector helpers shared by the CPU kernels: GCC/Clang vector extensions, so the same
// source compiles to AVX-512 where the CPU has it and to narrower registers elsewhere.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the AVX-512 intrinsics, used only where the compiler targets them
#endif

#include <cstdint>
#include <type_traits>

namespace pagedq_vec {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// GCC/Clang vector extensions: 16 float lanes, one AVX-512 register (two AVX2 ones
// elsewhere). `vfu` is the unaligned flavour used to load rows from the cache.
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));
constexpr int64_t kLanes = 16;

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }

// Sum of the lanes by halving (4 shuffle-adds), not a 16-add serial chain.
inline float hsum(vf v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// exp(x) for x <= 0, 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6
// Taylor polynomial (relative error < 2e-7), 2^n built in the exponent bits.
inline vf exp_nonpositive(vf x) {
  x = x < -87.f ? vf{} - 87.f : x;  // e^-87 is near float's smallest normal; smaller rounds to it
  const vf shifter = vf{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  vf n = x * 1.44269504088896341f + shifter;
  n -= shifter;
  vf r = x - n * 0.693145751953125f;
  r -= n * 1.42860682030941723212e-6f;
  vf p = vf{} + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * reinterpret_cast<vf&>(bits);
}

// 16 elements of a row in float32: float loaded as it is, bfloat16 widened in registers
// (its 16 bits are the top half of a float32), other types converted one by one.
template <typename T>
inline vf load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    vh bits = *reinterpret_cast<const vh*>(p);
    vi wide = __builtin_convertvector(bits, vi) << 16;
    return reinterpret_cast<vf&>(wide);
  } else {
    vf v;
    for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
    return v;
  }
}

// The first n elements at p (n <= 16, fewer at a row's end) as load_float reads them, the
// other lanes 0: one vector path serves a row whatever its length.
template <typename T>
inline vf load_float_n(const T* p, int64_t n) {
  if (n == kLanes) return load_float(p);
  vf v = {};
  for (int64_t i = 0; i < n; ++i) v[i] = to_float(p[i]);
  return v;
}

// 16 floats rounded to bfloat16 (nearest even, as c10::BFloat16 rounds): one VCVTNEPS2BF16
// where the CPU has AVX512-BF16 (which also flushes denormals, below 1.2e-38, to zero),
// else in integer steps (NaN kept a NaN).
inline vh to_bf16(vf v) {
#ifdef __AVX512BF16__
  return (vh)_mm512_cvtneps_pbh((__m512)v);
#else
  vi bits = reinterpret_cast<vi&>(v);
  vi rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
  return __builtin_convertvector(v != v ? vi{} + 0x7FC0 : rounded & 0xFFFF, vh);
#endif
}

// v rounded to T and back to float32: the value a PyTorch op with output dtype T holds.
template <typename T>
inline vf round_to(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    vi bits = __builtin_convertvector(to_bf16(v), vi) << 16;
    return reinterpret_cast<vf&>(bits);
  } else {
    for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(static_cast<T>(v[i]));
    return v;
  }
}

template <typename T>
inline void store_as(T* p, vf v) {
  if constexpr (std::is_same_v<T, float>) {
    store(p, v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    *reinterpret_cast<vh*>(p) = to_bf16(v);
  } else {
    for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<T>(v[i]);
  }
}

// The first n lanes of v stored as T (n <= 16), as store_as rounds them.
template <typename T>
inline void store_as_n(T* p, vf v, int64_t n) {
  if (n == kLanes) return store_as(p, v);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(v[i]);
}

// v as computed, kept from being fused into a following add (an FMA would skip the
// rounding of the product that PyTorch's separate multiply does).
inline vf materialized(vf v) {
#ifdef __AVX512F__
  asm("" : "+v"(v));  // one register
#else
  asm("" : "+m"(v));
#endif
  return v;
}

// 1 / x: the 14-bit reciprocal and a Newton step (relative error ~1e-7) where the CPU has
// AVX-512, a division (several times slower) elsewhere.
inline vf reciprocal(vf x) {
#ifdef __AVX512F__
  vf r = (vf)_mm512_rcp14_ps((__m512)x);
  return r * (2.f - x * r);
#else
  return 1.f / x;
#endif
}

}  // namespace pagedq_vec
