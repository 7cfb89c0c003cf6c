// Paged decode attention for XLA CPU: an XLA FFI custom call (handler PdjaxPagedDecodeAttention).
//
// One query token per row (the decode rows of DESIGN.md §2; a small mixed step's prompt tokens
// are rows too, see xla.token_rows), read straight out of the stacked paged cache
// [layers, num_pages, page_size, KVH, D] without gathering pages first. A work item is one
// row, or one KV head of a row (rows few, or the row long), or one KV head of a token group:
// up to 8 consecutive rows of one prompt chunk, which share a page table (run_problem).
//
// A row's item: pass 1 scores its keys page by page, 4 keys by 3 query heads at a time, so
// each key vector is converted once for 3 heads and each key row is read once; the softmax is
// exact, over a per-item score buffer; pass 2 reads each value row once and adds it into
// register-held output blocks of 3 heads by 4 vectors. A group's item (attend_group) widens
// each page to float32 once and scores it against its tokens' query rows held transposed, 8
// rows per multiply-add, so its keys and values are read and converted once for all its
// tokens. Both passes prefetch the next page as they go. Items run on XLA's intra-op thread
// pool, longest first.
//
// An FP8 cache (float8_e4m3fn values, fp8_kv.py) comes with float32 scales [L, NP, ps, KVH],
// one per token per KV head: a row's item multiplies each key's scores by its K scale after
// pass 1 and each probability by its V scale before pass 2 (the softmax sums are taken
// first); a group's item scales each widened key and value row.
//
// Indices that come from the host (layer, page ids, kv lens, num_rows) are clamped to the
// buffers' ranges before they address memory (page ids to [0, num_pages), as the Pallas kernels
// clamp them).
//
// Built on first use with the host compiler by kernel_cpu.py (with ../cpu_kernel_common.h),
// which also states the contract.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../cpu_kernel_common.h"

namespace ffi = xla::ffi;

namespace {

using pdjax_cpu::f32x8;
using pdjax_cpu::kLanes;
using pdjax_cpu::load8;
using pdjax_cpu::store8;

// float8_e4m3fn (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities, S.1111.111
// is NaN) widened by a 256-entry table.
struct Fp8E4M3 {
  uint8_t bits;
};

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 0xF, m = b & 7;
      float v = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                       : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 0xF && m == 7) v = NAN;
      value[b] = (b & 0x80) ? -v : v;
    }
  }
};
const Fp8Table kFp8Table;

inline f32x8 load8(const Fp8E4M3* p) {
  f32x8 v;
  for (int64_t j = 0; j < kLanes; ++j) v[j] = kFp8Table.value[p[j].bits];
  return v;
}

constexpr int64_t kKeysPerBlock = 4;  // keys scored together (independent FMA chains)
constexpr int64_t kCacheLine = 64;

inline float hsum(f32x8 v) {
  float s = 0;
  for (int64_t j = 0; j < kLanes; ++j) s += v[j];
  return s;
}

// exp(x) for x <= 0 (every argument here is a score minus its row's max; x > 0 is taken as
// 0, x < -87 as -87): 2^(x log2 e) split into 2^n (exponent bits) times 2^f, f in
// [-0.5, 0.5], by a degree-6 polynomial (relative error about 2e-7). Branch-free, so that
// loops over it vectorize; the exponent arithmetic is unsigned, so no input overflows.
inline float exp_nonpositive(float x) {
  x = std::min(std::max(x, -87.0f), 0.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.5403530393381609e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<uint32_t>(static_cast<int32_t>(n)) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Requests the `bytes` from p into L2 (the prefetch stream of the next page, see attend_item).
inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += kCacheLine) __builtin_prefetch(c + b, 0, 1);
}

// Pairwise sums of adjacent lanes of x and y, within each half: [x0+x1, x2+x3, y0+y1, y2+y3 |
// x4+x5, x6+x7, y4+y5, y6+y7] (AVX's hadd).
inline f32x8 hadd(f32x8 x, f32x8 y) {
  return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
}

// The lane sums of a, b, c, d into out[0..4).
inline void hsum4(f32x8 a, f32x8 b, f32x8 c, f32x8 d, float* out) {
  const f32x8 s = hadd(hadd(a, b), hadd(c, d));  // [a b c d | a b c d], half sums
  for (int64_t j = 0; j < 4; ++j) out[j] = s[j] + s[j + 4];
}

// Scores of NQ query rows (at q, q + D, ...) against the 4 keys at kb, kb + token_stride, ...
// into scores[a * stride + j]: each key vector is converted once and multiplies every query
// row, so one load feeds NQ multiply-adds (NQ x 4 sums and NQ queries fill the 16 registers).
template <int64_t NQ, typename T>
inline void score_keys4(const float* q, int64_t D, const T* kb, int64_t token_stride,
                        float* scores, int64_t stride) {
  static_assert(kKeysPerBlock == 4, "hsum4 reduces four keys");
  f32x8 acc[NQ][kKeysPerBlock] = {};
  for (int64_t d = 0; d < D; d += kLanes) {
    f32x8 qv[NQ];
    for (int64_t a = 0; a < NQ; ++a) qv[a] = load8(q + a * D + d);
    for (int64_t j = 0; j < kKeysPerBlock; ++j) {
      const f32x8 kv = load8(kb + j * token_stride + d);
      for (int64_t a = 0; a < NQ; ++a) acc[a][j] += qv[a] * kv;
    }
  }
  for (int64_t a = 0; a < NQ; ++a)
    hsum4(acc[a][0], acc[a][1], acc[a][2], acc[a][3], scores + a * stride);
}

// The query rows per register block: three (12 sums, 3 queries and the key in 16 registers).
constexpr int64_t kRowsPerBlock = 3;

// scores[(h * G + g) * stride + i] = q_{h, g} . key_{i, h} for the `run` keys of one page
// (key i, head h at k + i * token_stride + h * D) and H KV heads: q is [H * G, D] float32, D a
// multiple of kLanes. Keys go in blocks of 4, all heads of a block at once, so the page is
// read front to back; each block prefetches the same keys of the next page (`next`, or null).
template <typename T>
void score_run(const float* q, int64_t H, int64_t G, int64_t D, const T* k,
               int64_t token_stride, int64_t run, float* scores, int64_t stride,
               const T* next) {
  const int64_t key_bytes = H * D * static_cast<int64_t>(sizeof(T));
  int64_t i = 0;
  for (; i + kKeysPerBlock <= run; i += kKeysPerBlock) {
    if (next != nullptr)
      for (int64_t j = 0; j < kKeysPerBlock; ++j)
        prefetch_l2(next + (i + j) * token_stride, key_bytes);
    for (int64_t h = 0; h < H; ++h) {
      const T* kb = k + i * token_stride + h * D;
      for (int64_t g = 0; g < G; g += kRowsPerBlock) {
        const float* qg = q + (h * G + g) * D;
        float* out = scores + (h * G + g) * stride + i;
        switch (std::min(G - g, kRowsPerBlock)) {
          case 3: score_keys4<3>(qg, D, kb, token_stride, out, stride); break;
          case 2: score_keys4<2>(qg, D, kb, token_stride, out, stride); break;
          default: score_keys4<1>(qg, D, kb, token_stride, out, stride); break;
        }
      }
    }
  }
  for (; i < run; ++i) {
    if (next != nullptr) prefetch_l2(next + i * token_stride, key_bytes);
    for (int64_t h = 0; h < H; ++h) {
      const T* ki = k + i * token_stride + h * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + (h * G + g) * D;
        f32x8 acc = {};
        for (int64_t d = 0; d < D; d += kLanes) acc += load8(qg + d) * load8(ki + d);
        scores[(h * G + g) * stride + i] = hsum(acc);
      }
    }
  }
}

// out[a * D + d0 : ... + NC * kLanes] += sum_i p[a * row_stride + i * key_stride] *
// value_i[d0 : ...] for NQ query rows over the `run` values at v, v + token_stride, ...: each
// value vector is converted once and feeds every row; the NQ x NC sums stay in registers over
// the run. (Probabilities are row-major for a single row's item, key-major for a token group.)
template <int64_t NQ, int64_t NC, typename T>
inline void weigh_block(const float* p, int64_t row_stride, int64_t key_stride, const T* v,
                        int64_t token_stride, int64_t run, float* out, int64_t D, int64_t d0) {
  f32x8 acc[NQ][NC];
  for (int64_t a = 0; a < NQ; ++a)
    for (int64_t c = 0; c < NC; ++c) acc[a][c] = load8(out + a * D + d0 + c * kLanes);
  for (int64_t i = 0; i < run; ++i) {
    const T* vi = v + i * token_stride + d0;
    float w[NQ];
    for (int64_t a = 0; a < NQ; ++a) w[a] = p[a * row_stride + i * key_stride];
    for (int64_t c = 0; c < NC; ++c) {
      const f32x8 vv = load8(vi + c * kLanes);
      for (int64_t a = 0; a < NQ; ++a) acc[a][c] += w[a] * vv;
    }
  }
  for (int64_t a = 0; a < NQ; ++a)
    for (int64_t c = 0; c < NC; ++c) store8(out + a * D + d0 + c * kLanes, acc[a][c]);
}

// The output vectors per register block (times kRowsPerBlock rows: 12 sums).
constexpr int64_t kVectorsPerBlock = 4;

// weigh_block over all of D for NQ query rows.
template <int64_t NQ, typename T>
void weigh_rows(const float* p, int64_t row_stride, int64_t key_stride, const T* v,
                int64_t token_stride, int64_t run, float* out, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += kVectorsPerBlock * kLanes) {
    auto block = [&](auto nc) {
      weigh_block<NQ, decltype(nc)::value>(p, row_stride, key_stride, v, token_stride, run, out,
                                           D, d0);
    };
    switch (std::min(D - d0, kVectorsPerBlock * kLanes) / kLanes) {
      case 4: block(std::integral_constant<int64_t, 4>{}); break;
      case 3: block(std::integral_constant<int64_t, 3>{}); break;
      case 2: block(std::integral_constant<int64_t, 2>{}); break;
      default: block(std::integral_constant<int64_t, 1>{}); break;
    }
  }
}

// Probabilities times values for one page's run and H KV heads (head h's values at v + h * D,
// its G rows of probabilities and outputs at rows h * G of p and out); first prefetches the
// same keys of the next page (`next`, or null) for all H heads.
template <typename T>
void weigh_run(const float* p, int64_t H, int64_t G, int64_t D, const T* v,
               int64_t token_stride, int64_t run, float* out, int64_t stride, const T* next) {
  if (next != nullptr)
    for (int64_t i = 0; i < run; ++i)
      prefetch_l2(next + i * token_stride, H * D * static_cast<int64_t>(sizeof(T)));
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t g = 0; g < G; g += kRowsPerBlock) {
      const float* pg = p + (h * G + g) * stride;
      float* og = out + (h * G + g) * D;
      switch (std::min(G - g, kRowsPerBlock)) {
        case 3: weigh_rows<3>(pg, stride, 1, v + h * D, token_stride, run, og, D); break;
        case 2: weigh_rows<2>(pg, stride, 1, v + h * D, token_stride, run, og, D); break;
        default: weigh_rows<1>(pg, stride, 1, v + h * D, token_stride, run, og, D); break;
      }
    }
  }
}

struct Problem {
  int64_t rows, q_heads, kv_heads, head_dim, group;
  int64_t num_layers, num_pages, page_size, max_pages;
  int64_t layer, num_rows;
  float sm_scale, soft_cap, k_scale, v_scale;
  int64_t sliding_window;  // 0: none
  const float* q;          // [rows, QH, D]
  const void* k_cache;     // [L, NP, ps, KVH, D]
  const void* v_cache;
  const float* k_scales;   // [L, NP, ps, KVH] float32 per-token scales of an FP8 cache, or null
  const float* v_scales;
  const int32_t* kv_lens;       // [>= rows]
  const int32_t* page_indices;  // [>= rows, P]
  float* out;                   // [rows, QH, D]
};

// Per-thread buffers, grown to the largest item seen.
struct Scratch {
  std::vector<float> q, scores, inv_sum, acc, tile;
  std::vector<int64_t> lo, hi;
};

// The keys [*first, *kv_len) row r attends (its kv_len clamped to its page table, less what
// the sliding window drops); returns their count, 0 for rows past num_rows.
int64_t row_keys(const Problem& pb, int64_t r, int64_t* first, int64_t* kv_len) {
  *first = *kv_len = 0;
  if (r >= pb.num_rows) return 0;
  *kv_len = std::clamp<int64_t>(pb.kv_lens[r], 0, pb.max_pages * pb.page_size);
  if (pb.sliding_window > 0) *first = std::max<int64_t>(0, *kv_len - pb.sliding_window);
  return *kv_len - *first;
}

// The most tokens of one prompt chunk in a token group (M = 8 x G query rows per KV head:
// each widened key and value vector feeds 8 x G rows).
constexpr int64_t kGroupTokens = 8;

// One work item: rows [r0, r1) (one row, or consecutive tokens of one prompt chunk: a token
// group, see run_problem), KV heads [h0, h1), and its cost in query-key-heads.
struct Item {
  int64_t cost, r0, r1, h0, h1;
};

// The keys [first, kv_len) of one page table, visited in runs inside one page: each(fn) calls
// fn(s, offset, next, run) for every run, s its first key counted from `first`, offset its
// element offset in a layer of the cache, next the next page's (or -1). Pages are scattered,
// so the hardware prefetcher cannot run ahead of the loop: the passes prefetch the next
// page's keys as they go (measured 1.3-1.6 -> 0.9-1.0 ms for one thread, 16 rows at 300
// tokens of context, SmolLM2's heads).
struct PageRuns {
  const Problem& pb;
  const int32_t* table;
  int64_t first, kv_len;

  // Keys [start, end) of table slot i (a page), and that page's element offset of `start`.
  int64_t page_keys(int64_t i, int64_t* start, int64_t* end) const {
    const int64_t token_stride = pb.kv_heads * pb.head_dim;
    *start = std::max(i * pb.page_size, first);
    *end = std::min((i + 1) * pb.page_size, kv_len);
    const int64_t page = std::clamp<int64_t>(table[i], 0, pb.num_pages - 1);
    return (page * pb.page_size + *start % pb.page_size) * token_stride;
  }

  template <typename Fn>
  void each(Fn&& fn) const {
    const int64_t end_page = (kv_len + pb.page_size - 1) / pb.page_size;
    for (int64_t i = first / pb.page_size; i < end_page; ++i) {
      int64_t start, end, next_start, next_end;
      const int64_t offset = page_keys(i, &start, &end);
      const int64_t next = i + 1 < end_page ? page_keys(i + 1, &next_start, &next_end) : -1;
      fn(start - first, offset, next, end - start);
    }
  }
};

// Layer pb.layer of a cache.
template <typename T>
const T* layer_of(const Problem& pb, const void* cache) {
  return static_cast<const T*>(cache) +
         pb.layer * pb.num_pages * pb.page_size * pb.kv_heads * pb.head_dim;
}

// Layer pb.layer of a scale cache ([L, NP, ps, KVH]); the scale of the token whose element
// offset in a layer of the value cache is `off` (a multiple of KVH * D), head h, is at
// off / D + h.
inline const float* scales_of(const Problem& pb, const float* scales) {
  return scales + pb.layer * pb.num_pages * pb.page_size * pb.kv_heads;
}

// x[(hh * G + g) * stride + i] *= scale[i * KVH + h0 + hh] for the `run` keys of a run whose
// first token's scales start at `scale` (hh < H heads, g < G rows each).
inline void scale_run(float* x, int64_t H, int64_t G, int64_t stride, const float* scale,
                      int64_t kv_heads, int64_t h0, int64_t run) {
  for (int64_t hh = 0; hh < H; ++hh)
    for (int64_t g = 0; g < G; ++g) {
      float* xg = x + (hh * G + g) * stride;
      for (int64_t i = 0; i < run; ++i) xg[i] *= scale[i * kv_heads + h0 + hh];
    }
}

// One row (it.r0), KV heads [h0, h1): out[r, h0 * G : h1 * G, :]. A run's tokens are
// contiguous ([run, KVH, D]), so the heads of an item read it from L1 after the first.
template <typename T>
void attend_row(const Problem& pb, const Item& it, Scratch& scratch) {
  const int64_t r = it.r0, G = pb.group, D = pb.head_dim, HG = (it.h1 - it.h0) * G;
  float* out = pb.out + (r * pb.q_heads + it.h0 * G) * D;
  std::fill(out, out + HG * D, 0.0f);
  int64_t first, kv_len;
  const int64_t n_keys = row_keys(pb, r, &first, &kv_len);
  if (n_keys == 0) return;
  const int64_t token_stride = pb.kv_heads * D;
  const PageRuns runs{pb, pb.page_indices + r * pb.max_pages, first, kv_len};

  // The item's queries [HG, D], scaled (k_scale folds into the scores).
  scratch.q.resize(HG * D);
  float* qs = scratch.q.data();
  const float* q = pb.q + (r * pb.q_heads + it.h0 * G) * D;
  for (int64_t i = 0; i < HG * D; ++i) qs[i] = q[i] * pb.sm_scale * pb.k_scale;

  // Pass 1: scores [HG, n_keys] (query head h * G + g scores against KV head h's keys).
  scratch.scores.resize(HG * n_keys);
  float* sc = scratch.scores.data();
  const T* k_heads = layer_of<T>(pb, pb.k_cache) + it.h0 * D;
  const float* k_sc = pb.k_scales ? scales_of(pb, pb.k_scales) : nullptr;
  runs.each([&](int64_t s, int64_t off, int64_t next, int64_t run) {
    score_run(qs, it.h1 - it.h0, G, D, k_heads + off, token_stride, run, sc + s, n_keys,
              next < 0 ? nullptr : k_heads + next);
    if (k_sc) scale_run(sc + s, it.h1 - it.h0, G, n_keys, k_sc + off / D, pb.kv_heads, it.h0, run);
  });
  scratch.inv_sum.resize(HG);
  for (int64_t g = 0; g < HG; ++g) {
    float* sg = sc + g * n_keys;
    if (pb.soft_cap > 0)
      for (int64_t s = 0; s < n_keys; ++s) sg[s] = pb.soft_cap * std::tanh(sg[s] / pb.soft_cap);
    float m = sg[0];
    for (int64_t s = 1; s < n_keys; ++s) m = std::max(m, sg[s]);
    for (int64_t s = 0; s < n_keys; ++s) sg[s] = exp_nonpositive(sg[s] - m);
    f32x8 sum8 = {};
    int64_t s = 0;
    for (; s + kLanes <= n_keys; s += kLanes) sum8 += load8(sg + s);
    float sum = hsum(sum8);
    for (; s < n_keys; ++s) sum += sg[s];
    scratch.inv_sum[g] = pb.v_scale / sum;
  }
  // Pass 2: probabilities times values.
  const T* v_heads = layer_of<T>(pb, pb.v_cache) + it.h0 * D;
  const float* v_sc = pb.v_scales ? scales_of(pb, pb.v_scales) : nullptr;
  runs.each([&](int64_t s, int64_t off, int64_t next, int64_t run) {
    // The V scales weigh the probabilities (their sums are taken above, unscaled).
    if (v_sc) scale_run(sc + s, it.h1 - it.h0, G, n_keys, v_sc + off / D, pb.kv_heads, it.h0, run);
    weigh_run(sc + s, it.h1 - it.h0, G, D, v_heads + off, token_stride, run, out, n_keys,
              next < 0 ? nullptr : v_heads + next);
  });
  for (int64_t g = 0; g < HG; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] *= scratch.inv_sum[g];
}

// dst[i * D + d] = float(src[i * token_stride + d]) for the `run` keys or values of one page
// and one head; first prefetches the next page's (`next`, or null).
template <typename T>
void widen_run(const T* src, int64_t token_stride, int64_t D, int64_t run, float* dst,
               const T* next) {
  for (int64_t i = 0; i < run; ++i) {
    if (next != nullptr)
      prefetch_l2(next + i * token_stride, D * static_cast<int64_t>(sizeof(T)));
    for (int64_t d = 0; d < D; d += kLanes)
      store8(dst + i * D + d, load8(src + i * token_stride + d));
  }
}

// tile[i * D + d] *= scale[i * kv_heads] for the `run` widened rows of one head.
inline void scale_rows(float* tile, int64_t run, int64_t D, const float* scale,
                       int64_t kv_heads) {
  for (int64_t i = 0; i < run; ++i) {
    const float c = scale[i * kv_heads];
    for (int64_t d = 0; d < D; ++d) tile[i * D + d] *= c;
  }
}

// Scores of NK keys (float32 rows at k, k + D, ...) against NV x 8 query rows held
// transposed (qt[d * Mp + m]) into out[j * Mp + m]: each key element is broadcast against 8
// query rows at a time, so no sum crosses lanes (NK x NV sums, NV queries and the key fill
// the 16 registers).
template <int64_t NK, int64_t NV>
inline void score_keys_t(const float* qt, int64_t Mp, int64_t D, const float* k, float* out) {
  f32x8 acc[NK][NV] = {};
  for (int64_t d = 0; d < D; ++d) {
    f32x8 qv[NV];
    for (int64_t v = 0; v < NV; ++v) qv[v] = load8(qt + d * Mp + v * kLanes);
    for (int64_t j = 0; j < NK; ++j) {
      const f32x8 kv = f32x8{} + k[j * D + d];
      for (int64_t v = 0; v < NV; ++v) acc[j][v] += kv * qv[v];
    }
  }
  for (int64_t j = 0; j < NK; ++j)
    for (int64_t v = 0; v < NV; ++v) store8(out + j * Mp + v * kLanes, acc[j][v]);
}

// score_keys_t over `run` keys and NV vectors of query rows.
template <int64_t NV>
void score_run_t(const float* qt, int64_t Mp, int64_t D, const float* k, int64_t run,
                 float* out) {
  int64_t i = 0;
  for (; i + kKeysPerBlock <= run; i += kKeysPerBlock)
    score_keys_t<kKeysPerBlock, NV>(qt, Mp, D, k + i * D, out + i * Mp);
  for (; i < run; ++i) score_keys_t<1, NV>(qt, Mp, D, k + i * D, out + i * Mp);
}

// The rows of a token group, it.r0 .. it.r1 (consecutive tokens of one prompt chunk sharing
// one page table, see run_problem), KV heads [h0, h1). Per KV head its query rows are the n
// tokens x G heads (M = n * G, token-major), padded to Mp (a multiple of 8) and held
// transposed, and each page run is widened to float32 once: a key is then scored against 8
// rows per multiply-add, and every value vector feeds all M rows from L1. The group attends
// the union of its rows' keys, [first, kv_len); a row's scores outside its own keys get
// probability 0. Scores and probabilities are key-major ([n_keys, Mp]), so the softmax runs
// across rows in vectors.
template <typename T>
void attend_group(const Problem& pb, const Item& it, Scratch& scratch) {
  const int64_t G = pb.group, D = pb.head_dim, n = it.r1 - it.r0, M = n * G;
  const int64_t Mp = (M + kLanes - 1) / kLanes * kLanes;
  // The rows' keys [rows_lo[t], rows_hi[t]); rows of a group have kv_len > 0, one more each
  // (continues_group), so the last row's end is the group's.
  int64_t rows_lo[kGroupTokens], rows_hi[kGroupTokens];
  for (int64_t t = 0; t < n; ++t) row_keys(pb, it.r0 + t, &rows_lo[t], &rows_hi[t]);
  const int64_t first = *std::min_element(rows_lo, rows_lo + n);
  const int64_t kv_len = rows_hi[n - 1], n_keys = kv_len - first;
  const int64_t token_stride = pb.kv_heads * D;
  // The last row's table: continues_group matched each row's pages with the next row's, so
  // the last row's holds every earlier row's pages (and the rest of the group's keys).
  const PageRuns runs{pb, pb.page_indices + (it.r1 - 1) * pb.max_pages, first, kv_len};
  scratch.tile.resize(pb.page_size * D);
  float* tile = scratch.tile.data();
  scratch.q.resize(D * Mp);
  scratch.scores.resize(n_keys * Mp);
  scratch.inv_sum.resize(2 * Mp);
  scratch.acc.resize(M * D);
  float* qt = scratch.q.data();
  float* sc = scratch.scores.data();
  float* acc = scratch.acc.data();
  float* mx = scratch.inv_sum.data();  // per column: its max score
  float* sum = mx + Mp;                // and the sum of its probabilities
  // Column m's keys, counted from `first` (token m / G's; padding columns take all).
  scratch.lo.resize(Mp);
  scratch.hi.resize(Mp);
  int64_t* key_lo = scratch.lo.data();
  int64_t* key_hi = scratch.hi.data();
  for (int64_t m = 0; m < Mp; ++m) {
    key_lo[m] = m < M ? rows_lo[m / G] - first : 0;
    key_hi[m] = m < M ? rows_hi[m / G] - first : n_keys;
  }
  for (int64_t h = it.h0; h < it.h1; ++h) {
    // Queries, transposed and scaled: qt[d * Mp + t * G + g] (k_scale folds into the scores).
    std::fill(qt, qt + D * Mp, 0.0f);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const float* q = pb.q + ((it.r0 + t) * pb.q_heads + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d)
          qt[d * Mp + t * G + g] = q[d] * pb.sm_scale * pb.k_scale;
      }
    // Pass 1: scores [n_keys, Mp].
    const T* k_head = layer_of<T>(pb, pb.k_cache) + h * D;
    const float* k_sc = pb.k_scales ? scales_of(pb, pb.k_scales) + h : nullptr;
    const float* v_sc = pb.v_scales ? scales_of(pb, pb.v_scales) + h : nullptr;
    runs.each([&](int64_t s, int64_t off, int64_t next, int64_t run) {
      widen_run(k_head + off, token_stride, D, run, tile, next < 0 ? nullptr : k_head + next);
      if (k_sc) scale_rows(tile, run, D, k_sc + off / D, pb.kv_heads);
      for (int64_t v0 = 0; v0 < Mp; v0 += 3 * kLanes) {
        float* out = sc + s * Mp + v0;
        switch (std::min<int64_t>(Mp - v0, 3 * kLanes) / kLanes) {
          case 3: score_run_t<3>(qt + v0, Mp, D, tile, run, out); break;
          case 2: score_run_t<2>(qt + v0, Mp, D, tile, run, out); break;
          default: score_run_t<1>(qt + v0, Mp, D, tile, run, out); break;
        }
      }
    });
    if (pb.soft_cap > 0)
      for (int64_t e = 0; e < n_keys * Mp; ++e)
        sc[e] = pb.soft_cap * std::tanh(sc[e] / pb.soft_cap);
    // Softmax down each column (query row m) over its own keys [key_lo[m], key_hi[m]);
    // probability 0 elsewhere (padding columns: all keys, their scores are 0).
    std::fill(mx, mx + Mp, -INFINITY);
    std::fill(sum, sum + Mp, 0.0f);
    for (int64_t i = 0; i < n_keys; ++i)
      for (int64_t m = 0; m < Mp; ++m)
        if (i >= key_lo[m] && i < key_hi[m]) mx[m] = std::max(mx[m], sc[i * Mp + m]);
    for (int64_t i = 0; i < n_keys; ++i)
      for (int64_t m = 0; m < Mp; ++m) {
        const float p = exp_nonpositive(sc[i * Mp + m] - mx[m]);
        sc[i * Mp + m] = i >= key_lo[m] && i < key_hi[m] ? p : 0.0f;
        sum[m] += sc[i * Mp + m];
      }
    // Pass 2: probabilities times values, into acc [M, D].
    std::fill(acc, acc + M * D, 0.0f);
    const T* v_head = layer_of<T>(pb, pb.v_cache) + h * D;
    runs.each([&](int64_t s, int64_t off, int64_t next, int64_t run) {
      widen_run(v_head + off, token_stride, D, run, tile, next < 0 ? nullptr : v_head + next);
      if (v_sc) scale_rows(tile, run, D, v_sc + off / D, pb.kv_heads);
      const float* p = sc + s * Mp;
      const float* values = tile;
      for (int64_t m = 0; m < M; m += kRowsPerBlock) {
        switch (std::min(M - m, kRowsPerBlock)) {
          case 3: weigh_rows<3>(p + m, 1, Mp, values, D, run, acc + m * D, D); break;
          case 2: weigh_rows<2>(p + m, 1, Mp, values, D, run, acc + m * D, D); break;
          default: weigh_rows<1>(p + m, 1, Mp, values, D, run, acc + m * D, D); break;
        }
      }
    });
    for (int64_t t = 0; t < n; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t m = t * G + g;
        const float scale = pb.v_scale / sum[m];
        float* o = pb.out + ((it.r0 + t) * pb.q_heads + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[m * D + d] * scale;
      }
  }
}

// Whether row r + 1 continues row r's token group: the next token of the same chunk (one key
// more, the same page table over every page row r + 1 reads, so over all of row r's too).
bool continues_group(const Problem& pb, int64_t r) {
  if (r + 1 >= pb.num_rows) return false;
  int64_t first, a, b;
  row_keys(pb, r, &first, &a);
  row_keys(pb, r + 1, &first, &b);
  if (a <= 0 || b != a + 1) return false;
  const int64_t pages = (b + pb.page_size - 1) / pb.page_size;
  return std::memcmp(pb.page_indices + r * pb.max_pages, pb.page_indices + (r + 1) * pb.max_pages,
                     pages * sizeof(int32_t)) == 0;
}

// The work split. Consecutive rows of one prompt chunk (token_rows in xla.py makes every
// token a row over its request's pages) form token groups of up to kGroupTokens, one item per
// KV head each: a group reads its keys once for all its tokens (8 decode rows and 24 prompt
// tokens at a 2,000-token context, 30 layers of SmolLM2's heads: 57 -> 46-48 ms). Any other
// row is one item (each of its pages read front to back once) unless it costs more than a
// quarter of one thread's fair share, or the rows are too few to keep every thread busy:
// then it is one item per KV head. Items run longest first, claimed one at a time, so a long
// row's heads start early and the short rows fill in around them (without this, one
// 2,000-token prompt token after 8 decode rows at 300 ran on one thread after both had done
// the short rows: 19.2 ms for SmolLM2's 30 layers, against 8.9 for the 8 rows alone).
template <typename T>
void run_problem(const Problem& pb, ffi::ThreadPool pool) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  std::vector<int64_t> group_end(pb.rows), keys(pb.rows);
  int64_t total = 0;
  for (int64_t r = 0; r < pb.rows;) {
    int64_t end = r + 1;
    while (end - r < kGroupTokens && continues_group(pb, end - 1)) ++end;
    // The group's keys: from its first row's first key to its last row's kv_len.
    int64_t group_first, first, kv_len;
    row_keys(pb, r, &group_first, &kv_len);
    row_keys(pb, end - 1, &first, &kv_len);
    keys[r] = kv_len - group_first;
    group_end[r] = end;
    total += keys[r] * (end - r);
    r = end;
  }
  const bool few_rows = pb.num_rows < 4 * threads;
  std::vector<Item> items;
  items.reserve(pb.rows * pb.kv_heads);
  for (int64_t r = 0; r < pb.rows; r = group_end[r]) {
    const int64_t n = group_end[r] - r;
    const bool split = n > 1 || few_rows || keys[r] * 4 * threads > total;
    const int64_t per_item = split ? 1 : pb.kv_heads;
    for (int64_t h0 = 0; h0 < pb.kv_heads; h0 += per_item)
      items.push_back({keys[r] * n * per_item, r, group_end[r], h0, h0 + per_item});
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const Item* list = items.data();
  pdjax_cpu::parallel_for(pool, static_cast<int64_t>(items.size()), 1,
                          [pb, list](int64_t first, int64_t last) {
    thread_local Scratch scratch;
    for (int64_t i = first; i < last; ++i) {
      if (list[i].r1 - list[i].r0 > 1) attend_group<T>(pb, list[i], scratch);
      else attend_row<T>(pb, list[i], scratch);
    }
  });
}

ffi::Error decode_attention_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                 ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                 ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                                 ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                                 ffi::Buffer<ffi::S32> page_indices,
                                 ffi::Buffer<ffi::S32> num_rows, float sm_scale,
                                 int64_t sliding_window, float soft_cap, float k_scale,
                                 float v_scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || pd.size() != 2)
    return ffi::Error::InvalidArgument("decode_attention: q, k_cache or page_indices rank");
  if (k_cache.element_type() != v_cache.element_type())
    return ffi::Error::InvalidArgument("decode_attention: k_cache and v_cache dtypes differ");
  Problem pb;
  pb.rows = qd[0];
  pb.q_heads = qd[1];
  pb.head_dim = qd[2];
  pb.num_layers = kd[0];
  pb.num_pages = kd[1];
  pb.page_size = kd[2];
  pb.kv_heads = kd[3];
  pb.max_pages = pd[1];
  if (kd[4] != pb.head_dim || pb.kv_heads == 0 || pb.q_heads % pb.kv_heads != 0 ||
      pd[0] < pb.rows || kv_lens.element_count() < static_cast<size_t>(pb.rows) ||
      pb.num_pages == 0 || pb.num_layers == 0)
    return ffi::Error::InvalidArgument("decode_attention: inconsistent shapes");
  pb.group = pb.q_heads / pb.kv_heads;
  if (pb.head_dim % kLanes != 0)
    return ffi::Error::InvalidArgument("decode_attention: head_dim must be a multiple of 8");
  pb.layer = std::clamp<int64_t>(layer.typed_data()[0], 0, pb.num_layers - 1);
  pb.num_rows = std::clamp<int64_t>(num_rows.typed_data()[0], 0, pb.rows);
  pb.sm_scale = sm_scale;
  pb.soft_cap = soft_cap;
  pb.k_scale = k_scale;
  pb.v_scale = v_scale;
  pb.sliding_window = std::max<int64_t>(sliding_window, 0);
  pb.q = q.typed_data();
  pb.k_cache = k_cache.untyped_data();
  pb.v_cache = v_cache.untyped_data();
  // Scales: [L, NP, ps, KVH] float32 with an FP8 cache, [0] without.
  const size_t scale_count = static_cast<size_t>(pb.num_layers * pb.num_pages * pb.page_size *
                                                 pb.kv_heads);
  const bool fp8 = k_cache.element_type() == ffi::F8E4M3FN;
  if (k_scales.element_count() != (fp8 ? scale_count : 0) ||
      v_scales.element_count() != k_scales.element_count())
    return ffi::Error::InvalidArgument(
        "decode_attention: an FP8 cache needs k/v scales [L, NP, ps, KVH], another none");
  pb.k_scales = fp8 ? k_scales.typed_data() : nullptr;
  pb.v_scales = fp8 ? v_scales.typed_data() : nullptr;
  pb.kv_lens = kv_lens.typed_data();
  pb.page_indices = page_indices.typed_data();
  pb.out = out->typed_data();
  auto run = [&](auto element) { run_problem<decltype(element)>(pb, pool); };
  if (fp8) {
    run(Fp8E4M3{});
    return ffi::Error::Success();
  }
  return pdjax_cpu::with_float_type(k_cache.element_type(),
                                    "decode_attention: cache dtype not float32/bfloat16", run);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PdjaxPagedDecodeAttention, decode_attention_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // k_cache
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_scales ([0]: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_rows
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<float>("k_scale")
                                  .Attr<float>("v_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
