// Counting allocations in tests: lets a test check that a steady-state step allocates nothing.
// The unit-test binary replaces operator new and aligned_alloc (tests/unit/alloc_counter.cpp);
// each counts while counting is switched on for the calling thread and forwards to the function
// it replaces (the C++ runtime's or the sanitizer's), whose deallocation functions stay in place,
// so allocation and deallocation always come from the same family.
//
//   g_allocations = 0; g_count_allocations = true; ...; g_count_allocations = false;
#pragma once

#include <atomic>
#include <cstdint>

namespace d2o::test {

// Switches counting on or off for the calling thread (the flag itself is thread_local inside
// alloc_counter.cpp: an extern thread_local trips UBSan's null check under GCC 12).
void set_count_allocations(bool on);

// `g_count_allocations = true;` reads as a flag assignment in tests.
struct CountAllocationsFlag {
  CountAllocationsFlag& operator=(bool on) {
    set_count_allocations(on);
    return *this;
  }
};
inline CountAllocationsFlag g_count_allocations;

extern std::atomic<int64_t> g_allocations;

}  // namespace d2o::test
