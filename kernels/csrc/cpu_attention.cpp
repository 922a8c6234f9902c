// Paged attention and KV store for the CPU engine, reading the paged cache in place.
//
// Same contract as kernels/reference.py (the oracle these are tested against):
//   query   [num_tokens, num_heads, head_dim]         (packed sequences, back to back)
//   caches  [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables int32 [num_seqs, max_blocks], query_start_loc int32 [num_seqs + 1],
//   seq_lens int32 [num_seqs]. Query row i of sequence s sits at position
//   seq_lens[s] - q_len + i and attends to every key up to and including it.
//
// One work item is (sequence, tile of query rows), all heads: each block of the context
// is read once, sequentially, where it sits in the cache, and shared by every row and
// head of the item, so decodes, prefills and chunks after a cached prefix run in one call
// and no key or value is copied out of its block. Arithmetic is float32 whatever the
// storage dtype (bfloat16 scores are exact products summed in float32 by VDPBF16PS where
// the CPU has AVX512-BF16); an FP8 cache is scaled back by k_scale / v_scale. The next
// block of a sequence is prefetched while one is worked on.
//
// Row r of an item sees the keys [0, first_pos + r]; with a sliding window W (> 0) the
// lower bound rises to first_pos + r - W + 1 (as kernels.reference.outside_window), and
// blocks wholly below the first row's bound are not read.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace pagedq_vec;

// A cache or query row in float32: float rows are used where they are, others are
// converted into `buf` (bf16 by widening its bits, 16 at a time).
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    int64_t i = 0;
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      for (; i + kLanes <= n; i += kLanes) store(buf + i, load_float(src + i));
    for (; i < n; ++i) buf[i] = to_float(src[i]);
    return buf;
  }
}

// Cache row types read straight from their block, converted in registers: float32, and
// bfloat16, whose 16 bits are the top half of a float32. Other cache types (float16, FP8)
// are converted into a buffer per block first (as_float).
template <typename T>
constexpr bool kInRegister = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

template <typename R>
inline float dot(const float* a, const R* b, int64_t n) {
  int64_t i = 0;
  vf acc = {};
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load_float(b + i);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += a[i] * to_float(b[i]);
  return sum;
}

template <typename R>
inline void axpy(float a, const R* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, load(y + i) + a * load_float(x + i));
  for (; i < n; ++i) y[i] += a * to_float(x[i]);
}

// s[i] = exp(s[i] - m); returns their sum.
inline float exp_shifted(float* s, int64_t n, float m) {
  int64_t i = 0;
  vf total = {};
  for (; i + kLanes <= n; i += kLanes) {
    const vf e = exp_nonpositive(load(s + i) - m);
    store(s + i, e);
    total += e;
  }
  float sum = hsum(total);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// lane c of the result = the sum of v[c]'s lanes: 16 horizontal sums in 15 shuffle-add
// pairs (each level halves the lanes per vector and doubles the vectors per register),
// where one hsum per vector takes 4.
inline vf transpose_sum(const vf* v) {
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

inline float hmax(vf v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// Scores of `seen` keys (rows `stride` elements apart) against one query, 16 keys at a
// time: `part(c)` gives key c's products summed down to one vector, and transpose_sum turns
// 16 such vectors into 16 scores. Returns the largest score.
template <typename Part>
inline float scores_by_16(Part part, int64_t seen, float scale, float* p) {
  vf best = vf{} - FLT_MAX;
  for (int64_t c0 = 0; c0 < seen; c0 += kLanes) {
    const int64_t m = std::min(kLanes, seen - c0);
    vf parts[kLanes];
#pragma GCC unroll 16
    for (int64_t c = 0; c < kLanes; ++c) parts[c] = c < m ? part(c0 + c) : vf{};
    vf s = transpose_sum(parts) * scale;
    if (m == kLanes) {
      store(p + c0, s);
    } else {
      for (int64_t c = 0; c < m; ++c) p[c0 + c] = s[c];
      for (int64_t c = m; c < kLanes; ++c) s[c] = -FLT_MAX;  // lanes past the last key
    }
    best = vmax(s, best);
  }
  return hmax(best);
}

// The two inner loops of attention for one query vector over one block's `seen` keys
// (rows `stride` elements apart). With NC = head_dim / 16 known at compile time the query
// stays in registers across keys; NC = 0 handles any head_dim. `q` is scaled already.
template <int NC, typename R>
inline float block_scores(const float* q, const R* k, int64_t stride, int64_t seen, int64_t D, float* p) {
  if constexpr (NC > 0) {
    vf qr[NC];
    for (int i = 0; i < NC; ++i) qr[i] = load(q + i * kLanes);
    return scores_by_16(
        [&](int64_t c) {
          const R* kc = k + c * stride;
          vf part = qr[0] * load_float(kc);
          for (int i = 1; i < NC; ++i) part += qr[i] * load_float(kc + i * kLanes);
          return part;
        },
        seen, 1.f, p);
  } else {
    float block_max = -FLT_MAX;
    for (int64_t c = 0; c < seen; ++c) {
      p[c] = dot(q, k + c * stride, D);
      block_max = std::max(block_max, p[c]);
    }
    return block_max;
  }
}

#ifdef __AVX512BF16__
// bfloat16 queries and keys multiplied as they are stored: VDPBF16PS forms 32 products a
// step, exactly (a product of two bfloat16 fits a float32), summed in float32; the scale is
// applied to the sums, so no rounding is added to the query. NC = head_dim / 16 as above.
constexpr bool kHaveBf16Dots = true;

template <int NC>
inline float block_scores_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t stride, int64_t seen,
                               float scale, float* p) {
  static_assert(NC % 2 == 0, "head_dim must be a multiple of 32");
  __m512bh qr[NC / 2];
  for (int i = 0; i < NC / 2; ++i) qr[i] = (__m512bh)_mm512_loadu_si512(q + i * 2 * kLanes);
  return scores_by_16(
      [&](int64_t c) {
        const c10::BFloat16* kc = k + c * stride;
        __m512 part = _mm512_setzero_ps();
        for (int i = 0; i < NC / 2; ++i) part = _mm512_dpbf16_ps(part, qr[i], (__m512bh)_mm512_loadu_si512(kc + i * 2 * kLanes));
        return (vf)part;
      },
      seen, scale, p);
}
#else
constexpr bool kHaveBf16Dots = false;
#endif

// bfloat16 value rows with NC even are accumulated in "split" order: each 32 elements of a
// row as its 16 even elements, then its 16 odd ones. A 32-element load then becomes two
// float32 vectors with one operation each (the even elements are the low halves of the
// 32-bit lanes, shifted up; the odd ones the high halves, masked), where converting in
// order takes a widening shuffle and a shift per 16. `split_index` maps a position of the
// accumulator back to its element.
template <typename R, int NC>
constexpr bool kSplitRows = std::is_same_v<R, c10::BFloat16> && NC > 0 && NC % 2 == 0;

inline int64_t split_index(int64_t i) {
  const int64_t base = i / (2 * kLanes) * (2 * kLanes), lane = i % (2 * kLanes);
  return base + (lane < kLanes ? 2 * lane : 2 * (lane - kLanes) + 1);
}

template <int NC, typename R>
inline void block_values(const float* p, const R* v, int64_t stride, int64_t seen, int64_t D, float rescale,
                         float* a) {
  if constexpr (kSplitRows<R, NC>) {
    vf acc[NC];
    for (int i = 0; i < NC; ++i) acc[i] = load(a + i * kLanes) * rescale;
    const vi high_half = vi{} + static_cast<int32_t>(0xFFFF0000u);
    for (int64_t c = 0; c < seen; ++c) {
      const vi* row = reinterpret_cast<const vi*>(v + c * stride);
      for (int i = 0; i < NC / 2; ++i) {
        vi pair;
        __builtin_memcpy(&pair, row + i, sizeof(pair));  // unaligned
        vi even = pair << 16, odd = pair & high_half;
        acc[2 * i] += p[c] * reinterpret_cast<vf&>(even);
        acc[2 * i + 1] += p[c] * reinterpret_cast<vf&>(odd);
      }
    }
    for (int i = 0; i < NC; ++i) store(a + i * kLanes, acc[i]);
  } else if constexpr (NC > 0) {
    vf acc[NC];
    for (int i = 0; i < NC; ++i) acc[i] = load(a + i * kLanes) * rescale;
    for (int64_t c = 0; c < seen; ++c)
      for (int i = 0; i < NC; ++i) acc[i] += p[c] * load_float(v + c * stride + i * kLanes);
    for (int i = 0; i < NC; ++i) store(a + i * kLanes, acc[i]);
  } else {
    if (rescale != 1.f)
      for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
    for (int64_t c = 0; c < seen; ++c) axpy(p[c], v + c * stride, a, D);
  }
}

// 1, 2 and 4 measured on the 2-core EPYC: 1 was fastest or level (1.4-2.1x the one-burst prefetch of
// the whole next block at 64 decodes of 512 keys).
constexpr int64_t kPrefetchAhead = 1;

// Cache lines [first, end) of the bytes at p asked for.
inline void prefetch_lines(const void* p, int64_t first, int64_t end) {
  const char* bytes = static_cast<const char*>(p);
  for (int64_t line = first; line < end; ++line) __builtin_prefetch(bytes + 64 * line);
}

// One work item: a sequence's query rows [row_begin, row_end), every head.
struct Item {
  int64_t seq, row_begin, row_end;
};

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, group, block_size, table_stride;
};

// Query vectors per prefill item: enough rows to reuse each loaded block many times,
// few enough that the item's queries and accumulators stay in L1/L2.
constexpr int64_t kVectorsPerItem = 64;

inline int64_t tile_rows(const Shape& sh) { return std::max<int64_t>(kVectorsPerItem / sh.num_heads, 1); }

// Flash-style: blocks of the sequence's context in order, a running max and sum per query
// vector, so one pass reads every key and value block once, where it sits in the cache.
template <typename q_t, typename kv_t, int NC>
void attend(const Item& item, const q_t* query, const kv_t* key_cache, const kv_t* value_cache,
            const int32_t* block_tables, const int32_t* query_start_loc, const int32_t* seq_lens,
            q_t* out, const Shape& sh, float scale, float k_scale, float v_scale, int64_t window,
            std::vector<float>& scratch) {
  const int64_t D = sh.head_dim, H = sh.num_heads, G = sh.group, bs = sh.block_size;
  const int64_t q_begin = query_start_loc[item.seq];
  const int64_t q_len = query_start_loc[item.seq + 1] - q_begin;
  const int64_t seq_len = seq_lens[item.seq];
  const int64_t rows = item.row_end - item.row_begin;
  const int64_t vectors = rows * H;  // query vector j = r * H + h
  // Position of the item's first row: row r sees keys [0, first_pos + r].
  const int64_t first_pos = seq_len - q_len + item.row_begin;
  const int64_t num_keys = std::max<int64_t>(first_pos + rows, 0);  // keys the last row sees
  const int32_t* table = block_tables + item.seq * sh.table_stride;
  const int64_t block_elems = bs * sh.num_kv_heads * D;
  const int64_t stride = sh.num_kv_heads * D;  // between consecutive tokens of one head
  // A block's cache lines, and the share of them asked for ahead while each head is worked on.
  const int64_t block_lines = (block_elems * static_cast<int64_t>(sizeof(kv_t)) + 63) / 64;
  const int64_t lines_per_head = (block_lines + H - 1) / H;
  // Rows of the block as the inner loops read them: in place, or converted into k_buf / v_buf.
  using row_t = std::conditional_t<kInRegister<kv_t>, kv_t, float>;
  // bfloat16 queries against bfloat16 rows: scores by VDPBF16PS where the CPU has it.
  constexpr bool kBf16Dots = kHaveBf16Dots && std::is_same_v<row_t, c10::BFloat16> && NC > 0 && NC % 2 == 0;
  const q_t* query_rows = query + (q_begin + item.row_begin) * H * D;

  scratch.resize(2 * vectors * D + 2 * vectors + vectors * bs + (kInRegister<kv_t> ? 0 : 2 * block_elems));
  float* q = scratch.data();        // [vectors, D], scaled
  float* acc = q + vectors * D;     // [vectors, D]
  float* run_max = acc + vectors * D;
  float* run_sum = run_max + vectors;
  float* probs = run_sum + vectors;  // [vectors, bs]: this block's scores, then e^(s - max)
  float* k_buf = probs + vectors * bs;
  float* v_buf = k_buf + block_elems;

  if constexpr (!kBf16Dots) {  // the bfloat16 dot products read the query as it is
    for (int64_t j = 0; j < vectors; ++j) {
      const float* row = as_float(query_rows + j * D, q + j * D, D);
      for (int64_t d = 0; d < D; ++d) q[j * D + d] = row[d] * (scale * k_scale);
    }
  }
  std::fill(acc, acc + vectors * D, 0.f);
  std::fill(run_max, run_max + vectors, -FLT_MAX);
  std::fill(run_sum, run_sum + vectors, 0.f);

  // The first row's lowest key (0 without a window); later rows' bounds are higher.
  const int64_t first_low = window > 0 ? std::max<int64_t>(first_pos - window + 1, 0) : 0;
  for (int64_t c0 = first_low / bs * bs; c0 < num_keys; c0 += bs) {
    const int64_t n = std::min(bs, num_keys - c0);
    const int64_t block = table[c0 / bs];
    // Blocks sit anywhere in the cache, so the hardware cannot guess the next one: ask for
    // the one kPrefetchAhead blocks on while this one is worked on (a decode reads each
    // block once, from memory), a slice per head, so the requests are spread among the
    // work instead of one burst the memory system cannot queue.
    const bool ahead = c0 + kPrefetchAhead * bs < num_keys;
    const kv_t* ahead_keys = ahead ? key_cache + table[c0 / bs + kPrefetchAhead] * block_elems : nullptr;
    const kv_t* ahead_values = ahead ? value_cache + table[c0 / bs + kPrefetchAhead] * block_elems : nullptr;
    const row_t* keys;
    const row_t* values;
    if constexpr (kInRegister<kv_t>) {
      keys = key_cache + block * block_elems;
      values = value_cache + block * block_elems;
    } else {
      keys = as_float(key_cache + block * block_elems, k_buf, n * sh.num_kv_heads * D);
      values = as_float(value_cache + block * block_elems, v_buf, n * sh.num_kv_heads * D);
    }
    // Row r sees this block's keys [c0 + low, c0 + high); earlier rows may see none of them,
    // and with a window later rows may see none either.
    for (int64_t r = std::max<int64_t>(c0 - first_pos, 0); r < rows; ++r) {
      const int64_t high = std::min(n, first_pos + r + 1 - c0);
      const int64_t low = window > 0 ? std::clamp<int64_t>(first_pos + r - window + 1 - c0, 0, n) : 0;
      if (high <= low) continue;
      const int64_t seen = high - low;
      // Query head h reads KV head kv = h / G, counted rather than divided (a 64-bit
      // division per head cost as much as a quarter of a block's bookkeeping).
      for (int64_t h = 0, kv = 0, in_group = 0; h < H; ++h) {
        if (ahead && r == rows - 1) {
          const int64_t first = h * lines_per_head, end = std::min(first + lines_per_head, block_lines);
          prefetch_lines(ahead_keys, first, end);
          prefetch_lines(ahead_values, first, end);
        }
        const int64_t j = r * H + h;
        const row_t* k = keys + low * stride + kv * D;
        const row_t* v = values + low * stride + kv * D;
        if (++in_group == G) in_group = 0, ++kv;
        float* p = probs + j * bs;
        float block_max;
#ifdef __AVX512BF16__
        if constexpr (kBf16Dots)
          block_max = block_scores_bf16<NC>(query_rows + j * D, k, stride, seen, scale * k_scale, p);
        else
#endif
          block_max = block_scores<NC>(q + j * D, k, stride, seen, D, p);
        const float new_max = std::max(run_max[j], block_max);
        // 0 for the first block; 1 without a call to exp when the maximum stands (most blocks
        // after the first few: exp was a tenth of a decode's time).
        const float rescale = new_max == run_max[j] ? 1.f : std::exp(run_max[j] - new_max);
        run_sum[j] = run_sum[j] * rescale + exp_shifted(p, seen, new_max);
        run_max[j] = new_max;
        block_values<NC>(p, v, stride, seen, D, rescale, acc + j * D);
      }
    }
  }
  for (int64_t j = 0; j < vectors; ++j) {
    // A row with no keys (a padded lane, seq_len 0) outputs zeros, as the reference does.
    const float norm = run_sum[j] > 0.f ? v_scale / run_sum[j] : 0.f;
    q_t* dst = out + (q_begin + item.row_begin) * H * D + j * D;
    if constexpr (kSplitRows<row_t, NC>) {
      for (int64_t i = 0; i < D; ++i) dst[split_index(i)] = static_cast<q_t>(acc[j * D + i] * norm);
    } else {
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<q_t>(acc[j * D + d] * norm);
    }
  }
}

// Items dealt to threads longest first, each to the least loaded thread, so one long
// prefill does not leave the other threads idle behind a static split.
std::vector<std::vector<Item>> plan(const int32_t* query_start_loc, const int32_t* seq_lens, int64_t num_seqs,
                                    const Shape& sh, int64_t num_threads) {
  std::vector<std::pair<int64_t, Item>> costed;
  const int64_t step = tile_rows(sh);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
    for (int64_t begin = 0; begin < q_len; begin += step) {
      const int64_t end = std::min(begin + step, q_len);
      const int64_t keys = std::max<int64_t>(seq_lens[s] - q_len + end, 1);
      costed.push_back({keys * (end - begin + 1), Item{s, begin, end}});
    }
  }
  std::stable_sort(costed.begin(), costed.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::vector<Item>> buckets(num_threads);
  std::vector<int64_t> load(num_threads, 0);
  for (const auto& [cost, item] : costed) {
    const auto t = std::min_element(load.begin(), load.end()) - load.begin();
    buckets[t].push_back(item);
    load[t] += cost;
  }
  return buckets;
}

template <typename q_t, typename kv_t>
void run_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                   double scale, double k_scale, double v_scale, int64_t window, at::Tensor& out) {
  const Shape sh{query.size(1), key_cache.size(2), key_cache.size(3), query.size(1) / key_cache.size(2),
                 key_cache.size(1), block_tables.size(1)};
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const auto buckets = plan(qsl, lens, seq_lens.size(0), sh, at::get_num_threads());
  const q_t* q = query.data_ptr<q_t>();
  const kv_t* kc = key_cache.data_ptr<kv_t>();
  const kv_t* vc = value_cache.data_ptr<kv_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  q_t* o = out.data_ptr<q_t>();
  auto body = sh.head_dim == 64 ? attend<q_t, kv_t, 4> : sh.head_dim == 128 ? attend<q_t, kv_t, 8> : attend<q_t, kv_t, 0>;
  at::parallel_for(0, static_cast<int64_t>(buckets.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t t = begin; t < end; ++t)
      for (const Item& item : buckets[t])
        body(item, q, kc, vc, tables, qsl, lens, o, sh, static_cast<float>(scale), static_cast<float>(k_scale),
             static_cast<float>(v_scale), window, scratch);
  });
}

void check_inputs(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                  const at::Tensor& out) {
  for (const at::Tensor* t : {&query, &key_cache, &value_cache, &block_tables, &query_start_loc, &seq_lens, &out}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_attention_cpu: every tensor must be on the CPU");
    TORCH_CHECK(t->is_contiguous(), "paged_attention_cpu: every tensor must be contiguous");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "paged_attention_cpu: block_tables, query_start_loc and seq_lens must be int32");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_attention_cpu: query [T, H, D] and caches [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "paged_attention_cpu: head_dim must match and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "paged_attention_cpu: out must be like query");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) >= seq_lens.size(0),
              "paged_attention_cpu: query_start_loc [num_seqs + 1], block_tables [>= num_seqs, max_blocks]");
}

void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     double scale, double k_scale, double v_scale, int64_t sliding_window, at::Tensor out) {
  check_inputs(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out);
  TORCH_CHECK(sliding_window >= 0, "paged_attention_cpu: sliding_window must be >= 1, or 0 for none");
  const auto q_type = query.scalar_type(), kv_type = key_cache.scalar_type();
  TORCH_CHECK(kv_type == q_type || kv_type == at::kFloat8_e4m3fn,
              "paged_attention_cpu: the cache must have the query's dtype or be float8_e4m3fn");
#define PAGEDQ_ATTEND(q_t, kv_t)                                                                              \
  return run_attention<q_t, kv_t>(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, \
                                  k_scale, v_scale, sliding_window, out)
#define PAGEDQ_FOR_QUERY(q_t)                                               \
  if (kv_type == at::kFloat8_e4m3fn) PAGEDQ_ATTEND(q_t, c10::Float8_e4m3fn); \
  PAGEDQ_ATTEND(q_t, q_t)
  switch (q_type) {
    case at::kFloat: PAGEDQ_FOR_QUERY(float);
    case at::kBFloat16: PAGEDQ_FOR_QUERY(c10::BFloat16);
    case at::kHalf: PAGEDQ_FOR_QUERY(c10::Half);
    default: TORCH_CHECK(false, "paged_attention_cpu: query must be float32, bfloat16 or float16");
  }
#undef PAGEDQ_FOR_QUERY
#undef PAGEDQ_ATTEND
}

template <typename in_t, typename cache_t>
void store_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, double scale) {
  const int64_t tokens = src.size(0), heads = src.size(1), D = src.size(2);
  const int64_t token_stride = src.stride(0), head_stride = src.stride(1);
  const in_t* in = src.data_ptr<in_t>();
  cache_t* dst = cache.data_ptr<cache_t>();
  const float fscale = static_cast<float>(scale), limit = 448.f;  // e4m3's largest finite value
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // padding: nothing is stored
      for (int64_t h = 0; h < heads; ++h) {
        const in_t* row = in + t * token_stride + h * head_stride;
        cache_t* out = dst + (slots[t] * heads + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          if constexpr (std::is_same_v<cache_t, c10::Float8_e4m3fn>) {
            out[d] = static_cast<cache_t>(std::clamp(to_float(row[d]) / fscale, -limit, limit));
          } else {
            out[d] = row[d];
          }
        }
      }
    }
  });
}

void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
              const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  TORCH_CHECK(key.device().is_cpu() && key_cache.device().is_cpu(), "store_kv_cpu: tensors must be on the CPU");
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.dim() == 3 && value.stride(2) == 1,
              "store_kv_cpu: key and value [T, kv_heads, D] with contiguous rows");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "store_kv_cpu: caches must be contiguous");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3) && key.sizes() == value.sizes(),
              "store_kv_cpu: key/value heads and head_dim must match the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "store_kv_cpu: slot_mapping int64 [num_tokens]");
  const auto in_type = key.scalar_type(), cache_type = key_cache.scalar_type();
  TORCH_CHECK(value.scalar_type() == in_type && (cache_type == in_type || cache_type == at::kFloat8_e4m3fn),
              "store_kv_cpu: the cache must have the key's dtype or be float8_e4m3fn");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
#define PAGEDQ_STORE(in_t)                                                        \
  if (cache_type == at::kFloat8_e4m3fn) {                                         \
    store_rows<in_t, c10::Float8_e4m3fn>(key, key_cache, slots, k_scale);        \
    store_rows<in_t, c10::Float8_e4m3fn>(value, value_cache, slots, v_scale);    \
  } else {                                                                        \
    store_rows<in_t, in_t>(key, key_cache, slots, k_scale);                      \
    store_rows<in_t, in_t>(value, value_cache, slots, v_scale);                  \
  }                                                                               \
  return
  switch (in_type) {
    case at::kFloat: PAGEDQ_STORE(float);
    case at::kBFloat16: PAGEDQ_STORE(c10::BFloat16);
    case at::kHalf: PAGEDQ_STORE(c10::Half);
    default: TORCH_CHECK(false, "store_kv_cpu: key must be float32, bfloat16 or float16");
  }
#undef PAGEDQ_STORE
}

}  // namespace

TORCH_LIBRARY(pagedq_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, float k_scale, float v_scale, int sliding_window, "
      "Tensor(a!) out) -> ()");
  m.def(
      "store_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
      "float k_scale, float v_scale) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq_cpu, CPU, m) {
  m.impl("paged_attention", paged_attention);
  m.impl("store_kv", store_kv);
}
