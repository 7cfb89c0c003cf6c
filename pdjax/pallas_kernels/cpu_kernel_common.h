// Shared by the native XLA CPU kernels (ragged_paged_attention/kernel_cpu.cc and
// dense_cpu/kernel_cpu.cc): 8-lane float32 vectors (GCC/Clang vector extensions: one AVX2
// register, two SSE/NEON ones), bfloat16 loads, the float dtype dispatch and the work split
// over XLA's intra-op thread pool. cpu_build.py hashes this header into each kernel's key.

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace pdjax_cpu {

namespace ffi = xla::ffi;

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bfloat16 is the upper half of a float32.
inline f32x8 load8(const uint16_t* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
  f32x8 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof(v)); }

// Calls fn(float{}) for a float32 buffer and fn(uint16_t{}) for a bfloat16 one (the element
// type the kernels read); any other dtype is an InvalidArgument error saying `what`.
template <typename Fn>
ffi::Error with_float_type(ffi::DataType type, const char* what, Fn fn) {
  switch (type) {
    case ffi::F32:
      fn(float{});
      return ffi::Error::Success();
    case ffi::BF16:
      fn(uint16_t{});
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument(what);
  }
}

// Items [0, total) claimed in groups of `per_claim` from a shared counter by the calling thread
// and by up to pool.num_threads() - 1 helpers scheduled on the pool (more only oversubscribe
// the cores); run(first, last) does items [first, last). The caller waits only for groups some
// thread has claimed, so a pool whose threads are all busy (or a helper that starts after the
// work is done) never blocks it. Helpers hold copies of `run`, which must capture by value:
// one that starts after the call returned touches only its copy and the shared counters, and
// claims nothing.
template <typename Run>
void parallel_for(ffi::ThreadPool pool, int64_t total, int64_t per_claim, Run run) {
  struct Queue {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  if (total <= 0) return;
  per_claim = std::max<int64_t>(per_claim, 1);
  auto queue = std::make_shared<Queue>();
  auto work = [queue, total, per_claim, run] {
    for (;;) {
      const int64_t first = queue->next.fetch_add(per_claim);
      if (first >= total) return;
      const int64_t last = std::min(first + per_claim, total);
      run(first, last);
      if (queue->done.fetch_add(last - first) + (last - first) == total) {
        std::lock_guard<std::mutex> lock(queue->mu);
        queue->cv.notify_all();
      }
    }
  };
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t claims = (total + per_claim - 1) / per_claim;
  const int64_t helpers = std::min<int64_t>(threads - 1, claims - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    auto copy = work;
    pool.Schedule(std::move(copy));
  }
  work();
  std::unique_lock<std::mutex> lock(queue->mu);
  queue->cv.wait(lock, [&] { return queue->done.load() == total; });
}

}  // namespace pdjax_cpu
