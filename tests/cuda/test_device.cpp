// The device query: on a machine without a GPU it reports zero devices and why, never an error.
#include <gtest/gtest.h>

#include "cuda/device.h"

namespace zoe::cuda {
namespace {

TEST(CudaDevice, QueryReportsDevicesOrWhyNone) {
  Result<DeviceQuery> q = query_devices();
  ASSERT_TRUE(q.ok()) << q.status().to_string();
  if (q->count == 0) {
    EXPECT_FALSE(q->reason.empty());
    GTEST_SKIP() << q->reason;
  }
  EXPECT_FALSE(q->first_name.empty());
}

}  // namespace
}  // namespace zoe::cuda
