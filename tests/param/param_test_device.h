// The device the parameter suites run on. Meson runs each suite three times: on the host stand-in (memory of
// its own, asynchronous streams), with ZOE_TEST_DEVICE=cpu on the CPU itself (device memory is host memory:
// NVMe reads land in the pool, with no bounce), and with ZOE_TEST_DEVICE=cuda on the first GPU. Without a
// usable GPU the CUDA run skips every test (OnTestDevice), naming why; on a machine with one, any other
// failure to open it fails.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "zoe/device.h"
#include "zoe/param_tier.h"

namespace zoe {

inline bool test_device_is_cuda() {
  const char* d = std::getenv("ZOE_TEST_DEVICE");
  return d != nullptr && std::string(d) == "cuda";
}

inline bool test_device_is_cpu() {
  const char* d = std::getenv("ZOE_TEST_DEVICE");
  return d != nullptr && std::string(d) == "cpu";
}

inline std::unique_ptr<Device> make_test_device() {
  if (test_device_is_cpu()) return make_cpu_device();
  if (!test_device_is_cuda()) return make_host_device();
  Result<std::unique_ptr<Device>> d = make_cuda_device(0);
  if (!d.ok()) return nullptr;  // OnTestDevice has skipped or failed the test
  return std::move(d).value();
}

// A parameter tier in NVMe files under `paths`, the other options at their defaults.
inline ParamTierOptions nvme_home(std::vector<std::string> paths) {
  ParamTierOptions o;
  o.home = ParamHome::nvme;
  o.nvme_paths = std::move(paths);
  return o;
}

// The fixture of every test in these suites: skips, naming why, when the CUDA run finds no usable GPU.
class OnTestDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* d = std::getenv("ZOE_TEST_DEVICE");
    ASSERT_TRUE(d == nullptr || test_device_is_cuda() || test_device_is_cpu() || std::string(d) == "host")
        << "ZOE_TEST_DEVICE=" << d << ": host, cpu or cuda";
    if (!test_device_is_cuda()) return;
    Result<std::unique_ptr<Device>> cuda = make_cuda_device(0);
    if (!cuda.ok() && cuda.status().code() == StatusCode::unsupported) GTEST_SKIP() << cuda.status().to_string();
    ASSERT_TRUE(cuda.ok()) << cuda.status().to_string();
  }
};

}  // namespace zoe
