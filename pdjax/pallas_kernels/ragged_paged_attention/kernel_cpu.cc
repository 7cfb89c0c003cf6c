// Paged decode attention for XLA CPU: an XLA FFI custom call (handler PdjaxPagedDecodeAttention).
//
// One query token per row (the decode rows of DESIGN.md §2), read straight out of the stacked
// paged cache [layers, num_pages, page_size, KVH, D] without gathering pages first. A work item
// is one row, or one KV head of a row (rows few, or the row long: run_problem). Pass 1 scores
// the item's keys page by page, 4 keys by 3 query heads at a time, so each key vector is
// converted once for 3 heads and each key row is read once; the softmax is exact, over a
// per-item score buffer; pass 2 reads each value row once and adds it into register-held
// output blocks of 3 heads by 4 vectors. Both passes prefetch the next page as they go. Items
// run on XLA's intra-op thread pool, longest first.
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
#include <vector>

#include "../cpu_kernel_common.h"

namespace ffi = xla::ffi;

namespace {

using pdjax_cpu::f32x8;
using pdjax_cpu::kLanes;
using pdjax_cpu::load8;
using pdjax_cpu::store8;

constexpr int64_t kKeysPerBlock = 4;  // keys scored together (independent FMA chains)
constexpr int64_t kCacheLine = 64;

inline float hsum(f32x8 v) {
  float s = 0;
  for (int64_t j = 0; j < kLanes; ++j) s += v[j];
  return s;
}

// exp(x) for x <= 0 (every argument here is a score minus its row's max): 2^(x log2 e) split
// into 2^n (exponent bits) times 2^f, f in [-0.5, 0.5], by a degree-6 polynomial (relative
// error about 2e-7). Branch-free, so that loops over it vectorize.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
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
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
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

// out[a * D + d0 : ... + NC * kLanes] += sum_i p[a * stride + i] * value_i[d0 : ...] for NQ
// query rows over the `run` values at v, v + token_stride, ...: each value vector is converted
// once and feeds every row; the NQ x NC sums stay in registers over the run.
template <int64_t NQ, int64_t NC, typename T>
inline void weigh_block(const float* p, int64_t stride, const T* v, int64_t token_stride,
                        int64_t run, float* out, int64_t D, int64_t d0) {
  f32x8 acc[NQ][NC];
  for (int64_t a = 0; a < NQ; ++a)
    for (int64_t c = 0; c < NC; ++c) acc[a][c] = load8(out + a * D + d0 + c * kLanes);
  for (int64_t i = 0; i < run; ++i) {
    const T* vi = v + i * token_stride + d0;
    float w[NQ];
    for (int64_t a = 0; a < NQ; ++a) w[a] = p[a * stride + i];
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
void weigh_rows(const float* p, int64_t stride, const T* v, int64_t token_stride, int64_t run,
                float* out, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += kVectorsPerBlock * kLanes) {
    switch (std::min(D - d0, kVectorsPerBlock * kLanes) / kLanes) {
      case 4: weigh_block<NQ, 4>(p, stride, v, token_stride, run, out, D, d0); break;
      case 3: weigh_block<NQ, 3>(p, stride, v, token_stride, run, out, D, d0); break;
      case 2: weigh_block<NQ, 2>(p, stride, v, token_stride, run, out, D, d0); break;
      default: weigh_block<NQ, 1>(p, stride, v, token_stride, run, out, D, d0); break;
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
        case 3: weigh_rows<3>(pg, stride, v + h * D, token_stride, run, og, D); break;
        case 2: weigh_rows<2>(pg, stride, v + h * D, token_stride, run, og, D); break;
        default: weigh_rows<1>(pg, stride, v + h * D, token_stride, run, og, D); break;
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
  const int32_t* kv_lens;       // [>= rows]
  const int32_t* page_indices;  // [>= rows, P]
  float* out;                   // [rows, QH, D]
};

// Per-thread buffers, grown to the largest item seen.
struct Scratch {
  std::vector<float> q, scores, inv_sum;
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

// Row r, KV heads [h0, h1): out[r, h0 * G : h1 * G, :]. Keys [first, kv_len) are visited in
// runs inside one page; a run's tokens are contiguous ([run, KVH, D]), so the heads of an item
// read it from L1 after the first.
template <typename T>
void attend_item(const Problem& pb, int64_t r, int64_t h0, int64_t h1, Scratch& scratch) {
  const int64_t G = pb.group, D = pb.head_dim, HG = (h1 - h0) * G;
  float* out = pb.out + (r * pb.q_heads + h0 * G) * D;
  std::fill(out, out + HG * D, 0.0f);
  int64_t first, kv_len;
  const int64_t n_keys = row_keys(pb, r, &first, &kv_len);
  if (n_keys == 0) return;
  const int64_t token_stride = pb.kv_heads * D;
  const int64_t page_stride = pb.page_size * token_stride;
  const int64_t layer_stride = pb.num_pages * page_stride;
  const T* k_layer = static_cast<const T*>(pb.k_cache) + pb.layer * layer_stride;
  const T* v_layer = static_cast<const T*>(pb.v_cache) + pb.layer * layer_stride;
  const int32_t* table = pb.page_indices + r * pb.max_pages;
  const int64_t first_page = first / pb.page_size;
  const int64_t end_page = (kv_len + pb.page_size - 1) / pb.page_size;
  // Keys [start, end) of table slot i (a page), and that page's element offset of `start`.
  auto page_keys = [&](int64_t i, int64_t* start, int64_t* end) {
    *start = std::max(i * pb.page_size, first);
    *end = std::min((i + 1) * pb.page_size, kv_len);
    const int64_t page = std::clamp<int64_t>(table[i], 0, pb.num_pages - 1);
    return page * page_stride + (*start % pb.page_size) * token_stride;
  };
  // fn(s, offset, next, run): a run of keys inside one page; s its first key counted from
  // `first`, offset its element offset in the layer, next the next page's (or -1). Pages are
  // scattered, so the hardware prefetcher cannot run ahead of the loop: the passes prefetch
  // the next page's keys as they go (measured 1.3-1.6 -> 0.9-1.0 ms for one thread, 16 rows
  // at 300 tokens of context, SmolLM2's heads).
  auto for_each_run = [&](auto&& fn) {
    for (int64_t i = first_page; i < end_page; ++i) {
      int64_t start, end, next_start, next_end;
      const int64_t offset = page_keys(i, &start, &end);
      const int64_t next = i + 1 < end_page ? page_keys(i + 1, &next_start, &next_end) : -1;
      fn(start - first, offset, next, end - start);
    }
  };

  // The item's queries [HG, D], scaled (k_scale folds into the scores).
  scratch.q.resize(HG * D);
  float* qs = scratch.q.data();
  const float* q = pb.q + (r * pb.q_heads + h0 * G) * D;
  for (int64_t i = 0; i < HG * D; ++i) qs[i] = q[i] * pb.sm_scale * pb.k_scale;

  // Pass 1: scores [HG, n_keys] (query head h * G + g scores against KV head h's keys).
  scratch.scores.resize(HG * n_keys);
  float* sc = scratch.scores.data();
  const T* k_heads = k_layer + h0 * D;
  for_each_run([&](int64_t s, int64_t off, int64_t next, int64_t run) {
    score_run(qs, h1 - h0, G, D, k_heads + off, token_stride, run, sc + s, n_keys,
              next < 0 ? nullptr : k_heads + next);
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
  const T* v_heads = v_layer + h0 * D;
  for_each_run([&](int64_t s, int64_t off, int64_t next, int64_t run) {
    weigh_run(sc + s, h1 - h0, G, D, v_heads + off, token_stride, run, out, n_keys,
              next < 0 ? nullptr : v_heads + next);
  });
  for (int64_t g = 0; g < HG; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] *= scratch.inv_sum[g];
}

// One work item: KV heads [h0, h1) of a row, and its cost in key-heads to read.
struct Item {
  int64_t cost, row, h0, h1;
};

// The work split. A row is one item (each of its pages read front to back once) unless it
// costs more than a quarter of one thread's fair share, or the rows are too few to keep every
// thread busy: then it is one item per KV head. Items run longest first, claimed one at a
// time, so a long row's heads start early and the short rows fill in around them (without
// this, one 2,000-token prompt token after 8 decode rows at 300 ran on one thread after both
// had done the short rows: 19.2 ms for SmolLM2's 30 layers, against 8.9 for the 8 rows alone).
template <typename T>
void run_problem(const Problem& pb, ffi::ThreadPool pool) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  std::vector<int64_t> keys(pb.rows);
  int64_t total = 0;
  for (int64_t r = 0; r < pb.rows; ++r) {
    int64_t first, kv_len;
    keys[r] = row_keys(pb, r, &first, &kv_len);
    total += keys[r];
  }
  const bool few_rows = pb.num_rows < 4 * threads;
  std::vector<Item> items;
  items.reserve(pb.rows * pb.kv_heads);
  for (int64_t r = 0; r < pb.rows; ++r) {
    const bool split = few_rows || keys[r] * 4 * threads > total;
    const int64_t per_item = split ? 1 : pb.kv_heads;
    for (int64_t h0 = 0; h0 < pb.kv_heads; h0 += per_item)
      items.push_back({keys[r] * per_item, r, h0, h0 + per_item});
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const Item* list = items.data();
  pdjax_cpu::parallel_for(pool, static_cast<int64_t>(items.size()), 1,
                          [pb, list](int64_t first, int64_t last) {
    thread_local Scratch scratch;
    for (int64_t i = first; i < last; ++i)
      attend_item<T>(pb, list[i].row, list[i].h0, list[i].h1, scratch);
  });
}

ffi::Error decode_attention_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                 ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
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
  pb.kv_lens = kv_lens.typed_data();
  pb.page_indices = page_indices.typed_data();
  pb.out = out->typed_data();
  auto run = [&](auto element) { run_problem<decltype(element)>(pb, pool); };
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
