// Counting allocations in tests: lets a test check that a steady-state step allocates nothing.
// The unit-test binary replaces operator new and aligned_alloc (tests/unit/alloc_counter.cpp);
// each counts while g_count_allocations is set on the calling thread and forwards to the function
// it replaces (the C++ runtime's or the sanitizer's), whose deallocation functions stay in place,
// so allocation and deallocation always come from the same family.
#pragma once

#include <atomic>
#include <cstdint>

namespace d2o::test {

extern thread_local bool g_count_allocations;
extern std::atomic<int64_t> g_allocations;

}  // namespace d2o::test
