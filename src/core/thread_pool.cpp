#include "core/thread_pool.h"

#include "core/assert.h"
#include "core/cpu.h"

namespace d2o {

namespace {
// About 20-50 microseconds of spinning before a worker sleeps: long enough to bridge the gap
// between the kernels of one decode step, short enough not to burn a core when idle.
constexpr int kSpinIterations = 1 << 14;
// Spins of the dispatching thread before it starts yielding to the OS while it waits for tasks
// that workers have claimed but not finished.
constexpr int kWaitSpins = 1 << 12;
constexpr uint64_t kIndexMask = 0xffffffffull;
}  // namespace

thread_local const ThreadPool* ThreadPool::tl_pool_ = nullptr;
thread_local int ThreadPool::tl_thread_ = 0;

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::thread::hardware_concurrency());
  if (n_threads <= 0) n_threads = 1;
  n_threads_ = n_threads;
  workers_.reserve(static_cast<size_t>(n_threads_ - 1));
  for (int t = 1; t < n_threads_; ++t) workers_.emplace_back([this, t] { worker_loop(t); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  for (auto& w : workers_) w.join();
}

int64_t ThreadPool::run_tasks(uint32_t gen, TaskFn fn, void* ctx, int64_t n_tasks, int thread) {
  int64_t ran = 0;
  uint64_t c = claim_.load(std::memory_order_acquire);
  for (;;) {
    if (static_cast<uint32_t>(c >> 32) != gen) break;
    const int64_t task = static_cast<int64_t>(c & kIndexMask);
    if (task >= n_tasks) break;
    // On failure c is reloaded (another thread claimed a task, or a new job began).
    if (claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                     std::memory_order_acquire)) {
      fn(ctx, task, thread);
      ++ran;
      c = claim_.load(std::memory_order_acquire);
    }
  }
  return ran;
}

void ThreadPool::dispatch(int64_t n_tasks, TaskFn fn, void* ctx) {
  D2O_ASSERT(n_tasks <= static_cast<int64_t>(kIndexMask));
  const uint32_t gen = generation_.load(std::memory_order_relaxed) + 1;
  JobSlot& job = jobs_[gen & 1u];
  job.fn.store(fn, std::memory_order_release);
  job.ctx.store(ctx, std::memory_order_release);
  job.n_tasks.store(n_tasks, std::memory_order_release);
  done_.store(0, std::memory_order_relaxed);
  claim_.store(static_cast<uint64_t>(gen) << 32, std::memory_order_release);
  generation_.store(gen, std::memory_order_release);
  generation_.notify_all();

  const ThreadPool* outer = tl_pool_;
  const int outer_thread = tl_thread_;
  tl_pool_ = this;
  tl_thread_ = 0;
  const int64_t mine = run_tasks(gen, fn, ctx, n_tasks, 0);
  tl_pool_ = outer;
  tl_thread_ = outer_thread;
  // Every task is claimed; wait only for those that workers are still running. Spin briefly,
  // then yield: a worker descheduled in the middle of a task needs the time slice.
  const int64_t theirs = n_tasks - mine;
  for (int i = 0; done_.load(std::memory_order_acquire) < theirs; ++i) {
    if (i < kWaitSpins)
      cpu_relax();
    else
      std::this_thread::yield();
  }
}

void ThreadPool::worker_loop(int thread) {
  uint32_t seen = 0;
  for (;;) {
    uint32_t g = generation_.load(std::memory_order_acquire);
    for (int i = 0; g == seen && i < kSpinIterations; ++i) {
      cpu_relax();
      g = generation_.load(std::memory_order_acquire);
    }
    if (g == seen) {
      generation_.wait(seen, std::memory_order_acquire);
      continue;
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    // The job of generation g (or a later one, in which case nothing can be claimed for g).
    const JobSlot& job = jobs_[g & 1u];
    const TaskFn fn = job.fn.load(std::memory_order_acquire);
    void* ctx = job.ctx.load(std::memory_order_acquire);
    const int64_t n = job.n_tasks.load(std::memory_order_acquire);
    tl_pool_ = this;
    tl_thread_ = thread;
    const int64_t ran = run_tasks(g, fn, ctx, n, thread);
    tl_pool_ = nullptr;
    if (ran > 0) done_.fetch_add(ran, std::memory_order_acq_rel);
  }
}

}  // namespace d2o
