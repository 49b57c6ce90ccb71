// ThreadPool: work dispatched right after construction is done (regression: a worker that
// started after the first dispatch used to skip it and the caller waited forever), and
// parallel_for covers every index exactly once.
#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "core/thread_pool.h"

namespace d2o {
namespace {

TEST(ThreadPool, FirstDispatchRightAfterConstruction) {
  for (int trial = 0; trial < 100; ++trial) {
    ThreadPool pool(2 + trial % 2);
    std::atomic<int> done{0};
    pool.run(8, [&](int64_t, int) { done.fetch_add(1); });
    ASSERT_EQ(done.load(), 8) << "trial " << trial;
  }
}

TEST(ThreadPool, ParallelForCoversEveryIndexOnce) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(1000);
  pool.parallel_for(1000, 7, [&](int64_t b, int64_t e, int thread) {
    ASSERT_GE(thread, 0);
    ASSERT_LT(thread, 3);
    for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
  });
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
}

}  // namespace
}  // namespace d2o
