#include <gtest/gtest.h>

#include "d2o/status.h"

namespace d2o {
namespace {

Result<int> parse_positive(int x) {
  if (x <= 0) return invalid_argument("must be positive");
  return x;
}

Result<int> twice(int x) {
  D2O_ASSIGN_OR_RETURN(int v, parse_positive(x));
  return 2 * v;
}

TEST(Status, OkAndErrorsCarryMessages) {
  EXPECT_TRUE(Status().ok());
  Status s = format_error("bad magic").with_context("model.gguf");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kFormatError);
  EXPECT_EQ(s.message(), "model.gguf: bad magic");
  EXPECT_EQ(s.to_string(), "format error: model.gguf: bad magic");
}

TEST(Status, AssignOrReturnPropagates) {
  auto ok = twice(3);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 6);
  auto bad = twice(-1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace d2o
