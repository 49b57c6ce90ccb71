#include "core/thread_pool.h"

#include "core/assert.h"
#include "core/cpu.h"

namespace d2o {

namespace {
// About 20-50 microseconds of spinning before a worker sleeps: long enough to bridge the gap
// between the kernels of one decode step, short enough not to burn a core when idle.
constexpr int kSpinIterations = 1 << 14;
// Spins of the dispatching thread before it starts yielding to the OS while it waits.
constexpr int kWaitSpins = 1 << 12;
}  // namespace

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::thread::hardware_concurrency());
  if (n_threads <= 0) n_threads = 1;
  n_threads_ = n_threads;
  workers_.reserve(n_threads_ - 1);
  for (int t = 1; t < n_threads_; ++t) workers_.emplace_back([this, t] { worker_loop(t); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::work_on_current_job(int thread) {
  for (;;) {
    const int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= job_n_tasks_) break;
    job_fn_(job_ctx_, task, thread);
  }
}

void ThreadPool::dispatch(int64_t n_tasks, TaskFn fn, void* ctx) {
  D2O_ASSERT(active_workers_.load(std::memory_order_acquire) == 0);
  job_fn_ = fn;
  job_ctx_ = ctx;
  job_n_tasks_ = n_tasks;
  next_task_.store(0, std::memory_order_relaxed);
  active_workers_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  work_on_current_job(0);
  // Wait for the workers to leave the job (they may still be running their last task). Spin
  // briefly, then yield: when the machine is oversubscribed a worker may have been descheduled,
  // and spinning would burn the time slice it needs to finish.
  for (int i = 0; active_workers_.load(std::memory_order_acquire) != 0; ++i) {
    if (i < kWaitSpins) cpu_relax();
    else std::this_thread::yield();
  }
}

void ThreadPool::worker_loop(int thread) {
  // Generation 0 is the state at construction: a worker that starts late must still take part
  // in the first job, so it must not read the (possibly already bumped) current generation.
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
    work_on_current_job(thread);
    active_workers_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace d2o
