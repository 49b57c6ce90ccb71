// ThreadPool: a small fork-join pool for the kernels.
//
// One pool is created by the front end and passed explicitly to whatever needs it (no singleton).
// The calling thread takes part in the work, so a pool of n threads starts n-1 workers. Workers
// spin briefly after each job (decode issues hundreds of short jobs per token, so waking through
// the OS each time would dominate) and then sleep on an atomic wait.
//
// Determinism: parallel_for splits [0, n) into chunks whose boundaries depend only on n and the
// grain, never on the number of threads, so a reduction done per chunk and combined in chunk order
// gives bit-identical results for any thread count.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace d2o {

class ThreadPool {
 public:
  // n_threads <= 0 picks std::thread::hardware_concurrency().
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int n_threads() const { return n_threads_; }

  // Calls fn(task, thread) for every task in [0, n_tasks) and returns when all are done.
  // `thread` is in [0, n_threads()) and identifies per-thread scratch space.
  template <class F>
  void run(int64_t n_tasks, F&& fn) {
    if (n_tasks <= 0) return;
    if (n_threads_ == 1 || n_tasks == 1) {
      for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
      return;
    }
    using Fn = std::remove_reference_t<F>;
    dispatch(n_tasks, [](void* ctx, int64_t task, int thread) { (*static_cast<Fn*>(ctx))(task, thread); },
             const_cast<void*>(static_cast<const void*>(&fn)));
  }

  // Calls fn(begin, end, thread) on chunks of [0, n) of `grain` elements (the last may be short).
  template <class F>
  void parallel_for(int64_t n, int64_t grain, F&& fn) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    const int64_t n_chunks = (n + grain - 1) / grain;
    run(n_chunks, [&](int64_t c, int thread) {
      const int64_t b = c * grain;
      const int64_t e = b + grain < n ? b + grain : n;
      fn(b, e, thread);
    });
  }

 private:
  using TaskFn = void (*)(void* ctx, int64_t task, int thread);
  void dispatch(int64_t n_tasks, TaskFn fn, void* ctx);
  void worker_loop(int thread);
  void work_on_current_job(int thread);

  int n_threads_ = 1;
  std::vector<std::thread> workers_;

  // The current job. Written by the caller before `generation_` is bumped.
  TaskFn job_fn_ = nullptr;
  void* job_ctx_ = nullptr;
  int64_t job_n_tasks_ = 0;
  alignas(64) std::atomic<int64_t> next_task_{0};
  alignas(64) std::atomic<int> active_workers_{0};  // workers still inside the current job
  alignas(64) std::atomic<uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace d2o
