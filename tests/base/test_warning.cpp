// base/warning.h: the library's warnings reach stderr in one format, or the sink a program installs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "base/warning.h"

namespace zoe {
namespace {

TEST(Warning, GoesToStderrWithOnePrefix) {
  ::testing::internal::CaptureStderr();
  warn("a retried write");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "zoe: warning: a retried write\n");
}

TEST(Warning, GoesToTheSinkInstalledUntilItIsRemoved) {
  std::vector<std::string> seen;
  set_warning_sink([&seen](std::string_view m) { seen.emplace_back(m); });
  ::testing::internal::CaptureStderr();
  warn("one");
  warn("two");
  set_warning_sink(nullptr);
  warn("three");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "zoe: warning: three\n");
  EXPECT_EQ(seen, (std::vector<std::string>{"one", "two"}));
}

}  // namespace
}  // namespace zoe
