#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "core/thread_pool.h"

namespace d2o {
namespace {

// A pool used immediately after construction (workers may not have started yet) must not lose
// a job: this once deadlocked.
TEST(ThreadPool, FreshPoolsRunEveryTask) {
  for (int rep = 0; rep < 200; ++rep) {
    ThreadPool pool(1 + rep % 4);
    std::atomic<int> sum{0};
    pool.run(10, [&](int64_t t, int) { sum += static_cast<int>(t); });
    EXPECT_EQ(sum.load(), 45);
  }
}

TEST(ThreadPool, ManyShortJobsAndThreadIds) {
  ThreadPool pool(3);
  std::vector<int> seen(3, 0);
  for (int job = 0; job < 2000; ++job) {
    std::atomic<int> n{0};
    pool.run(7, [&](int64_t, int thread) {
      ASSERT_GE(thread, 0);
      ASSERT_LT(thread, 3);
      n++;
    });
    ASSERT_EQ(n.load(), 7);
  }
}

TEST(ThreadPool, ParallelForChunksDependOnlyOnNAndGrain) {
  for (int threads : {1, 2, 5}) {
    ThreadPool pool(threads);
    std::vector<std::pair<int64_t, int64_t>> chunks(4);
    pool.parallel_for(10, 3, [&](int64_t b, int64_t e, int) { chunks[static_cast<size_t>(b / 3)] = {b, e}; });
    EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 6}, {6, 9}, {9, 10}}));
  }
}

TEST(ThreadPool, ParallelForCoversEveryIndexOnce) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(1000);
  pool.parallel_for(1000, 7, [&](int64_t b, int64_t e, int thread) {
    ASSERT_GE(thread, 0);
    ASSERT_LT(thread, 3);
    for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)].fetch_add(1);
  });
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << i;
}

}  // namespace
}  // namespace d2o
