// D2O_ASSERT: invariant checks that stay on in release builds.
//
// Only for conditions that hold unless d2o itself has a bug. Input from outside is validated with
// Status (include/d2o/status.h) and never reaches an assert.
#pragma once

namespace d2o::detail {
[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const char* msg);
}  // namespace d2o::detail

#define D2O_ASSERT(cond)                                                          \
  do {                                                                            \
    if (__builtin_expect(!(cond), 0))                                             \
      ::d2o::detail::assert_fail(#cond, __FILE__, __LINE__, nullptr);             \
  } while (0)

#define D2O_ASSERT_MSG(cond, msg)                                                 \
  do {                                                                            \
    if (__builtin_expect(!(cond), 0))                                             \
      ::d2o::detail::assert_fail(#cond, __FILE__, __LINE__, (msg));               \
  } while (0)
