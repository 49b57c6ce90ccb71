// ThreadPool: a small fork-join pool for the kernels.
//
// One pool is created by the front end and passed explicitly to whatever needs it (no singleton).
// The calling thread takes part in the work, so a pool of n threads starts n-1 workers. Workers
// spin briefly after each job (decode issues a few hundred short jobs per token, so waking through
// the OS each time would dominate) and then sleep on an atomic wait.
//
// A job ends when its tasks are done, not when every worker has seen it: tasks are claimed one by
// one (compare-and-swap on a word holding the job's generation and the next task index), so a
// worker that the OS has descheduled, or that is still asleep, simply misses the job and the
// caller runs the remaining tasks itself. On a machine shared with other processes this keeps a
// parallel region from stalling for a whole scheduler time slice; a worker that wakes up late can
// only claim tasks of the current job.
//
// Determinism: parallel_for splits [0, n) into chunks whose boundaries depend only on n and the
// grain, never on the number of threads, so a reduction done per chunk and combined in chunk order
// gives bit-identical results for any thread count.
//
// A run() issued from inside one of the pool's own tasks (nested parallelism) runs its tasks
// inline on that thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <type_traits>
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
  // `thread` is in [0, n_threads()) and identifies per-thread scratch space: two tasks with the
  // same `thread` never run at the same time.
  template <class F>
  void run(int64_t n_tasks, F&& fn) {
    if (n_tasks <= 0) return;
    const bool nested = tl_pool_ == this;
    if (n_threads_ == 1 || n_tasks == 1 || nested) {
      const int thread = nested ? tl_thread_ : 0;
      for (int64_t t = 0; t < n_tasks; ++t) fn(t, thread);
      return;
    }
    using Fn = std::remove_reference_t<F>;
    dispatch(
        n_tasks,
        [](void* ctx, int64_t task, int thread) { (*static_cast<Fn*>(ctx))(task, thread); },
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
  // Claims and runs tasks of job `gen` until none is left; returns how many it ran.
  int64_t run_tasks(uint32_t gen, TaskFn fn, void* ctx, int64_t n_tasks, int thread);

  // Per thread: the pool whose task it is running (a nested run() on that pool runs inline) and
  // its thread index there.
  static thread_local const ThreadPool* tl_pool_;
  static thread_local int tl_thread_;

  int n_threads_ = 1;
  std::vector<std::thread> workers_;

  // The job of generation g lives in slot g % 2, written by the caller before the generation is
  // published. A worker that saw generation g may be descheduled and read the slot late: by then
  // the slot can hold job g + 2, but only after the claim word moved on to g + 1 (the caller
  // publishes a claim word before it fills the next slot). The slot is stored with release and
  // read with acquire, so a worker that reads any value of a later job also sees the claim word
  // of a later generation and cannot claim a task of g with it. (With one shared slot a late
  // worker could read job g + 1 while the claim word still named g and run a task of g + 1 that
  // its caller then handed out again.)
  struct JobSlot {
    std::atomic<TaskFn> fn{nullptr};
    std::atomic<void*> ctx{nullptr};
    std::atomic<int64_t> n_tasks{0};
  };
  JobSlot jobs_[2];
  // (generation << 32) | index of the next unclaimed task.
  alignas(64) std::atomic<uint64_t> claim_{0};
  // Tasks of the current job finished by workers (the caller counts its own).
  alignas(64) std::atomic<int64_t> done_{0};
  // Generation of the current job; workers sleep on it.
  alignas(64) std::atomic<uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace d2o
