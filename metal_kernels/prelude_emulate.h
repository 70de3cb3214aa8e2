// mlxtune kernel prelude: a CPU emulation of one GPU threadgroup, for testing kernel bodies on
// machines without a GPU. Each GPU thread is a coroutine (ucontext) with its own stack;
// KSHARED storage is static, so the threads of the running group share it; KBARRIER() hands
// control back to the scheduler, which resumes every thread once all have reached the barrier,
// in a fresh random order each time, so a body that reads shared memory before the barrier
// that publishes it gets stale data. A thread that finishes while others wait at a barrier is
// reported as a divergent barrier.
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 600  // macOS declares the ucontext functions only for X/Open
#endif
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace kemu {
struct Thread {
  ucontext_t ctx;
  int state;  // 0 running, 1 waiting (at a barrier or not started), 2 finished
};
static int n_threads = 0;
static int cur = 0;
static int bx = 0;
static int by = 0;
static long n_barriers = 0;
static ucontext_t main_ctx;
static std::vector<Thread> threads;
static std::vector<char> stacks;
static float scratch[1024];
constexpr long STACK = 1 << 16;

inline void barrier() {
  threads[cur].state = 1;
  swapcontext(&threads[cur].ctx, &main_ctx);
}

// A SIMD-group reduction: lanes 32*w .. 32*w+31 of the group. Every thread of the group must
// call it (the emulation passes two barriers).
inline float simd_reduce(float x, bool is_max) {
  scratch[cur] = x;
  barrier();
  int w0 = cur & ~31;
  int w1 = std::min(w0 + 32, n_threads);
  float r = scratch[w0];
  for (int i = w0 + 1; i < w1; ++i) r = is_max ? (r > scratch[i] ? r : scratch[i]) : r + scratch[i];
  barrier();
  return r;
}

// Runs entry() as every thread of every group of a (gx, gy) grid; 0 on success, 1 on a
// divergent barrier.
inline int run_grid(void (*entry)(), int gx, int gy, int tg, unsigned seed) {
  n_threads = tg;
  threads.assign(tg, Thread{});
  stacks.assign(size_t(tg) * STACK, 0);
  std::mt19937 rng(seed);
  std::vector<int> order(tg);
  std::iota(order.begin(), order.end(), 0);
  for (by = 0; by < gy; ++by) {
    for (bx = 0; bx < gx; ++bx) {
      for (int t = 0; t < tg; ++t) {
        getcontext(&threads[t].ctx);
        threads[t].ctx.uc_stack.ss_sp = &stacks[size_t(t) * STACK];
        threads[t].ctx.uc_stack.ss_size = STACK;
        threads[t].ctx.uc_link = &main_ctx;
        makecontext(&threads[t].ctx, entry, 0);
        threads[t].state = 1;
      }
      for (;;) {
        std::shuffle(order.begin(), order.end(), rng);
        for (int t : order) {
          cur = t;
          threads[t].state = 0;
          swapcontext(&main_ctx, &threads[t].ctx);
        }
        int done = 0;
        for (int t = 0; t < tg; ++t) done += threads[t].state == 2;
        if (done == tg) break;
        if (done > 0) return 1;
        ++n_barriers;
      }
    }
  }
  return 0;
}
}  // namespace kemu

#define KEXP(x) std::exp(x)
#define KLOG(x) std::log(x)
#define KTANH(x) std::tanh(x)
inline float ksimd_sum(float x) { return kemu::simd_reduce(x, false); }
inline float ksimd_max(float x) { return kemu::simd_reduce(x, true); }
