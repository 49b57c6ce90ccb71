// The allocation counter of tests/common/alloc_counter.h (one definition per test binary).
#include "common/alloc_counter.h"

#include "core/sanitizer.h"

#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdlib>
#include <new>

namespace {
thread_local bool t_counting = false;
}  // namespace

namespace d2o::test {
std::atomic<int64_t> g_allocations{0};
void set_count_allocations(bool on) {
  t_counting = on;
}
}  // namespace d2o::test

void* operator new(size_t n) {
  using NewFn = void* (*)(size_t);
  static const NewFn next = reinterpret_cast<NewFn>(dlsym(RTLD_NEXT, "_Znwm"));
  if (t_counting) d2o::test::g_allocations.fetch_add(1, std::memory_order_relaxed);
  return next(n);
}

// AlignedBuffer (caches, activations, scratch) allocates with aligned_alloc, and blocks of
// kMappedBytes or more as anonymous mappings (below).
extern "C" void* aligned_alloc(size_t align, size_t n) {
  using AlignedFn = void* (*)(size_t, size_t);
  static const AlignedFn next = reinterpret_cast<AlignedFn>(dlsym(RTLD_NEXT, "aligned_alloc"));
  if (t_counting) d2o::test::g_allocations.fetch_add(1, std::memory_order_relaxed);
  return next(align, n);
}

// Sanitizer builds keep every AlignedBuffer block in malloc (core/mem.cpp); ThreadSanitizer's
// start-up would also call this wrapper before dlsym can be used.
#if !D2O_SANITIZED
extern "C" void* mmap(void* addr, size_t n, int prot, int flags, int fd, off_t off) {
  using MmapFn = void* (*)(void*, size_t, int, int, int, off_t);
  static const MmapFn next = reinterpret_cast<MmapFn>(dlsym(RTLD_NEXT, "mmap"));
  if (t_counting && (flags & MAP_ANONYMOUS))
    d2o::test::g_allocations.fetch_add(1, std::memory_order_relaxed);
  return next(addr, n, prot, flags, fd, off);
}
#endif
