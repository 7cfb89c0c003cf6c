// Dense matmul for XLA CPU: an XLA FFI custom call (handler PdjaxPackedMatmul).
//
// y [M, N] f32 = x [M, K] f32 @ w, with w given packed: [P, K, 24] float32 or bfloat16, panel
// p holding the output columns [24p, 24p + 24) of a [K, N] weight (the last panel
// zero-padded; pack_weight in dense_cpu/__init__.py). Only the first `rows` rows of x are
// multiplied (rows [1] int32, clamped to [0, M]); the rest of y is zero. A step's token stream
// is padded to a compiled bucket, and its padding rows cost nothing here.
//
// XLA CPU runs a dot of a few rows on one thread, so a model's projections use one of the
// cores; and a column panel of a row-major [K, N] weight is a column of 96-byte pieces one row
// apart, which the hardware prefetcher does not follow. Packed, a panel is one contiguous
// stream. Panels are claimed from a shared counter by the calling thread and by helpers on
// XLA's intra-op pool, so every core streams its own share.
//
// Per panel, each block of at most kRows rows of x (run_panel) is multiplied into 3 register
// accumulators a row (8 float32 lanes each) over the whole of K: the panel is read from memory
// by the first block and from cache by the others (the hardware prefetcher follows the one
// stream; software prefetches ahead of it measured slower). Each output is one sum over K in
// order, so results differ from XLA's dot only by float32 rounding (DESIGN.md §5).
//
// Built on first use with the host compiler by pdjax/pallas_kernels/cpu_build.py (with
// cpu_kernel_common.h); the contract is in dense_cpu/__init__.py.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../cpu_kernel_common.h"

namespace ffi = xla::ffi;

namespace {

using pdjax_cpu::f32x8;
using pdjax_cpu::kLanes;
using pdjax_cpu::load8;
using pdjax_cpu::store8;

constexpr int64_t kPanel = 3 * kLanes;  // output columns per panel
#if defined(__AVX512F__)
constexpr int kRows = 9;  // 32 vector registers: 27 accumulators, 3 weights, 1 broadcast
#else
constexpr int kRows = 4;  // 16 vector registers: 12 accumulators
#endif

struct Problem {
  int64_t m, n, k;
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

// panel_block for a block of `rows` rows, 1 <= rows <= kRows.
template <typename T, int R = kRows>
void row_block(const Problem& pb, int64_t p, int64_t m0, int64_t cols, int rows) {
  if constexpr (R > 0) {
    if (rows == R) return panel_block<T, R>(pb, p, m0, cols);
    row_block<T, R - 1>(pb, p, m0, cols, rows);
  }
}

// The m rows in the fewest blocks of at most kRows, of near-equal size (16 rows: 8 + 8, not
// 9 + 7): every block after the first reads the panel again from cache and converts it
// again, so the count of blocks is the cost (a mixed step's 8 decode rows and 1 prompt
// token, 9 rows, take one block on AVX-512 instead of 8 + 1).
template <typename T>
void run_panel(const Problem& pb, int64_t p) {
  const int64_t cols = std::min(kPanel, pb.n - p * kPanel);
  const int64_t blocks = (pb.m + kRows - 1) / kRows;
  for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
    const int64_t m1 = pb.m * (b + 1) / blocks;
    row_block<T>(pb, p, m0, cols, static_cast<int>(m1 - m0));
    m0 = m1;
  }
}

// Panels claimed from a shared counter by the calling thread and the pool's threads, about 8
// claims a thread: few enough that the counter stays cold, enough to even out.
template <typename T>
void run_problem(const Problem& pb, ffi::ThreadPool pool) {
  const int64_t panels = (pb.n + kPanel - 1) / kPanel;
  if (pb.m == 0) return;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  pdjax_cpu::parallel_for(pool, panels, panels / (8 * threads), [pb](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) run_panel<T>(pb, p);
  });
}

ffi::Error packed_matmul_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("packed_matmul: x, w, y must be rank 2, 3, 2");
  if (rows.element_count() != 1)
    return ffi::Error::InvalidArgument("packed_matmul: rows must hold one int32");
  Problem pb;
  pb.k = xd[1];
  pb.n = yd[1];
  const int64_t panels = wd[0];
  if (wd[1] != pb.k || wd[2] != kPanel || yd[0] != xd[0] || pb.n > panels * kPanel ||
      pb.n <= (panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("packed_matmul: shapes of x, w and y do not match");
  pb.m = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  pb.x = x.typed_data();
  pb.w = w.untyped_data();
  pb.y = y->typed_data();
  std::memset(pb.y + pb.m * pb.n, 0, (xd[0] - pb.m) * pb.n * sizeof(float));
  auto run = [&](auto element) { run_problem<decltype(element)>(pb, pool); };
  return pdjax_cpu::with_float_type(w.element_type(),
                                    "packed_matmul: w must be float32 or bfloat16", run);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PdjaxPackedMatmul, packed_matmul_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // w [P, K, 24]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [1]: rows to compute
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
