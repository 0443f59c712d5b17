// The host stand-in device: its gradient statistics against a float64 reference, for every dtype and for
// the values that are easy to get wrong (subnormals, Inf, NaN, the largest finite values).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "tests/reference.h"
#include "zoe/device.h"

namespace zoe {
namespace {

class HostGradStats : public ::testing::TestWithParam<DType> {};

TEST_P(HostGradStats, MatchesFloat64Reference) {
  const DType dtype = GetParam();
  test::Random rng(7);
  std::vector<float> values;
  for (int i = 0; i < 10007; ++i) values.push_back(static_cast<float>(rng.uniform(-3, 3)));
  // Subnormal and extreme values of the dtype, then the non-finite ones.
  const float tiny = dtype == DType::f16 ? 3e-7f : 1e-39f;
  const float big = dtype == DType::f16 ? 65504.0f : 1e30f;
  values.insert(values.end(), {tiny, -tiny, big, -big, 0.0f, -0.0f});
  const std::size_t finite = values.size();
  values.insert(values.end(), {INFINITY, -INFINITY, NAN});

  std::vector<unsigned char> bytes(values.size() * dtype_size(dtype));
  double expected = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    float stored = values[i];
    if (dtype == DType::f32) {
      std::memcpy(&bytes[i * 4], &stored, 4);
    } else {
      const std::uint16_t h = dtype == DType::f16 ? float_to_f16(values[i]) : float_to_bf16(values[i]);
      std::memcpy(&bytes[i * 2], &h, 2);
      stored = dtype == DType::f16 ? f16_to_float(h) : bf16_to_float(h);
    }
    if (i < finite) expected += static_cast<double>(stored) * stored;
  }

  std::unique_ptr<Device> device = make_host_device();
  void* on_device = device->allocate(bytes.size()).value();
  ASSERT_TRUE(device->copy_to_device(on_device, bytes.data(), bytes.size(), Stream::h2d).ok());
  GradStats stats;
  ASSERT_TRUE(device->grad_stats(on_device, dtype, values.size(), &stats, Stream::h2d).ok());
  ASSERT_TRUE(device->synchronize().ok());
  EXPECT_EQ(stats.non_finite, 3u);
  EXPECT_NEAR(stats.sum_sq, expected, expected * test::kSumSqRelTol);
  // A subnormal alone: its square is what counts, not zero.
  GradStats one;
  ASSERT_TRUE(device->grad_stats(static_cast<unsigned char*>(on_device) + (finite - 6) * dtype_size(dtype), dtype, 1,
                                 &one, Stream::h2d).ok());
  ASSERT_TRUE(device->synchronize().ok());
  EXPECT_GT(one.sum_sq, 0.0);
  device->free(on_device);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, HostGradStats, ::testing::Values(DType::f32, DType::f16, DType::bf16),
                         [](const auto& p) { return std::string(dtype_name(p.param)); });

// Host waits are counted once per synchronize that finds the device busy (the all-streams form waits per
// stream inside), by whose thread waited; one that finds the work done is not a wait.
TEST(HostDeviceWaits, CountedOncePerCallByKindOfThread) {
  std::unique_ptr<Device> device = make_host_device();
  const HostWaits start = device->host_waits();
  EXPECT_EQ(start.trainer_calls + start.worker_calls, 0u);
  ASSERT_TRUE(device->simulate_compute(0.02, Stream::compute).ok());
  ASSERT_TRUE(device->synchronize().ok());
  ASSERT_TRUE(device->simulate_compute(0.02, Stream::d2h).ok());
  Result<EventId> e = device->record(Stream::d2h);
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE(device->synchronize(e.value()).ok());
  HostWaits w = device->host_waits();
  EXPECT_EQ(w.trainer_calls, 2u);

  EXPECT_GE(w.trainer_s, 0.02) << "the first wait outlasted the 20 ms of compute";
  EXPECT_EQ(w.worker_calls, 0u);
  std::thread worker([&] {
    mark_worker_thread();
    ASSERT_TRUE(device->simulate_compute(0.02, Stream::h2d).ok());
    Result<EventId> f = device->record(Stream::h2d);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE(device->synchronize(f.value()).ok());
  });
  worker.join();
  w = device->host_waits();
  EXPECT_EQ(w.trainer_calls, 2u);
  EXPECT_EQ(w.worker_calls, 1u);
  EXPECT_FALSE(on_worker_thread());
}

}  // namespace
}  // namespace zoe
