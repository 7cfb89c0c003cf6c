// Dense matmul for XLA CPU: an XLA FFI custom call (handler PdjaxPackedMatmul).
//
// y [M, N] f32 = x [M, K] f32 @ w, with w given packed: [P, K, 24] float32 or bfloat16, panel
// p holding the output columns [24p, 24p + 24) of a [K, N] weight (the last panel
// zero-padded; pack_weight in dense_cpu/__init__.py). XLA CPU runs a dot of a few rows on one
// thread, so a model's projections use one of the cores; and a column panel of a row-major
// [K, N] weight is a column of 96-byte pieces one row apart, which the hardware prefetcher does
// not follow. Packed, a panel is one contiguous stream. Panels are claimed from a shared
// counter by the calling thread and by helpers on XLA's intra-op pool, so every core streams
// its own share.
//
// Per panel, each block of kRows rows of x is multiplied into kRows x 3 register accumulators
// (8 float32 lanes each) over the whole of K: the panel is read from memory by the first block
// and from cache by the others (the hardware prefetcher follows the one stream; software
// prefetches ahead of it measured slower). Each output is one sum over K in order, so results
// differ from XLA's dot only by float32 rounding (DESIGN.md §5).
//
// Built on first use with the host compiler by pdjax/pallas_kernels/cpu_build.py; the contract
// is in dense_cpu/__init__.py.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;
constexpr int64_t kPanel = 3 * kLanes;  // output columns per panel
#if defined(__AVX512F__)
constexpr int kRows = 8;  // 32 vector registers: 24 accumulators
#else
constexpr int kRows = 4;  // 16 vector registers: 12 accumulators
#endif

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f32x8 load8(const uint16_t* p) {  // bfloat16 is the upper half of a float32
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
  f32x8 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof(v)); }

struct Problem {
  int64_t m, n, k, panels;
  const float* x;
  const void* w;
  float* y;
};

// Rows [m0, m0 + R) of x times panel p, into the panel's columns of y (the first `cols`).
template <typename T, int R>
void panel_block(const Problem& pb, int64_t p, int64_t m0, int64_t cols) {
  const T* w = static_cast<const T*>(pb.w) + p * pb.k * kPanel;
  const float* x = pb.x + m0 * pb.k;
  f32x8 acc[R][3];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = f32x8{};
  for (int64_t kk = 0; kk < pb.k; ++kk) {
    const T* wr = w + kk * kPanel;
    const f32x8 w0 = load8(wr), w1 = load8(wr + kLanes), w2 = load8(wr + 2 * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float b = x[r * pb.k + kk];
      acc[r][0] += b * w0;
      acc[r][1] += b * w1;
      acc[r][2] += b * w2;
    }
  }
  float* y = pb.y + m0 * pb.n + p * kPanel;
  for (int r = 0; r < R; ++r) {
    if (cols == kPanel) {
      store8(y + r * pb.n, acc[r][0]);
      store8(y + r * pb.n + kLanes, acc[r][1]);
      store8(y + r * pb.n + 2 * kLanes, acc[r][2]);
    } else {  // the last panel of an N that is not a multiple of 24
      float tmp[kPanel];
      store8(tmp, acc[r][0]);
      store8(tmp + kLanes, acc[r][1]);
      store8(tmp + 2 * kLanes, acc[r][2]);
      std::memcpy(y + r * pb.n, tmp, cols * sizeof(float));
    }
  }
}

template <typename T, int R = kRows - 1>
void tail_block(const Problem& pb, int64_t p, int64_t m0, int64_t cols, int rows) {
  if constexpr (R > 0) {
    if (rows == R) return panel_block<T, R>(pb, p, m0, cols);
    tail_block<T, R - 1>(pb, p, m0, cols, rows);
  }
}

template <typename T>
void run_panel(const Problem& pb, int64_t p) {
  const int64_t cols = std::min(kPanel, pb.n - p * kPanel);
  int64_t m0 = 0;
  for (; m0 + kRows <= pb.m; m0 += kRows) panel_block<T, kRows>(pb, p, m0, cols);
  if (m0 < pb.m) tail_block<T>(pb, p, m0, cols, static_cast<int>(pb.m - m0));
}

// Panels [0, total) claimed in groups from a shared counter by the calling thread and by
// helpers on the pool; the caller waits only for groups some thread has claimed, so a pool
// whose threads are all busy (or a helper that starts after the work is done) never blocks it.
struct WorkQueue {
  int64_t total;
  int64_t per_claim;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

template <typename T>
void run_panels(const Problem& pb, WorkQueue& wq) {
  for (;;) {
    const int64_t first = wq.next.fetch_add(wq.per_claim);
    if (first >= wq.total) return;
    const int64_t last = std::min(first + wq.per_claim, wq.total);
    for (int64_t p = first; p < last; ++p) run_panel<T>(pb, p);
    if (wq.done.fetch_add(last - first) + (last - first) == wq.total) {
      std::lock_guard<std::mutex> lock(wq.mu);
      wq.cv.notify_all();
    }
  }
}

template <typename T>
void run_problem(const Problem& pb, ffi::ThreadPool pool) {
  // The calling thread works too: one helper fewer than the pool's threads.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  auto wq = std::make_shared<WorkQueue>();
  wq->total = (pb.n + kPanel - 1) / kPanel;
  if (wq->total == 0 || pb.m == 0) return;
  // About 8 claims a thread: few enough that the counter stays cold, enough to even out.
  wq->per_claim = std::max<int64_t>(1, wq->total / (8 * threads));
  const int64_t claims = (wq->total + wq->per_claim - 1) / wq->per_claim;
  const int64_t helpers = std::min<int64_t>(threads - 1, claims - 1);
  // Helpers copy the problem: a helper that starts after the call returned touches only its
  // own copy and the shared queue, and claims nothing.
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([pb, wq] { run_panels<T>(pb, *wq); });
  run_panels<T>(pb, *wq);
  std::unique_lock<std::mutex> lock(wq->mu);
  wq->cv.wait(lock, [&] { return wq->done.load() == wq->total; });
}

ffi::Error packed_matmul_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                              ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("packed_matmul: x, w, y must be rank 2, 3, 2");
  Problem pb;
  pb.m = xd[0];
  pb.k = xd[1];
  pb.n = yd[1];
  pb.panels = wd[0];
  if (wd[1] != pb.k || wd[2] != kPanel || yd[0] != pb.m || pb.n > pb.panels * kPanel ||
      pb.n <= (pb.panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("packed_matmul: shapes of x, w and y do not match");
  pb.x = x.typed_data();
  pb.w = w.untyped_data();
  pb.y = y->typed_data();
  switch (w.element_type()) {
    case ffi::F32:
      run_problem<float>(pb, pool);
      break;
    case ffi::BF16:
      run_problem<uint16_t>(pb, pool);
      break;
    default:
      return ffi::Error::InvalidArgument("packed_matmul: w must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PdjaxPackedMatmul, packed_matmul_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // w [P, K, 24]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
