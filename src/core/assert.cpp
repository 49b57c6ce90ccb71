#include "core/assert.h"

#include <cstdio>
#include <cstdlib>

namespace d2o::detail {

// The one place that ends the process: an invariant of d2o itself was broken (a bug).
void assert_fail(const char* expr, const char* file, int line, const char* msg) {
  std::fprintf(stderr, "d2o: internal invariant violated at %s:%d: %s%s%s\n", file, line, expr,
               msg ? " -- " : "", msg ? msg : "");
  std::fflush(stderr);
  std::abort();  // D2O_ASSERT
}

}  // namespace d2o::detail
