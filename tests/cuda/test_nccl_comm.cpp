// The NCCL communicator with one rank: reduce_scatter and all_gather are then the identity. Skips without a
// GPU; built without NCCL, checks that the communicator says so.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda/cuda_device.h"
#include "cuda/device.h"
#include "cuda/nccl_comm.h"
#include "zoe/dtype.h"

namespace zoe::cuda {
namespace {

class NcclTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    Result<DeviceQuery> query = query_devices();
    ASSERT_TRUE(query.ok()) << query.status().to_string();
    if (query->count == 0) GTEST_SKIP() << query->reason;
    Result<std::unique_ptr<CudaDevice>> created = CudaDevice::create(0);
    ASSERT_TRUE(created.ok()) << created.status().to_string();
    device_ = std::move(created).value();
  }

  std::unique_ptr<CudaDevice> device_;
};

#ifdef ZOE_HAVE_NCCL

TEST_P(NcclTest, SingleRankCollectivesAreIdentity) {
  const DType dtype = GetParam();
  const std::size_t esize = dtype_size(dtype);
  constexpr std::size_t kCount = 100003;
  Result<NcclUniqueId> id = NcclCommunicator::make_unique_id();
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  Result<std::unique_ptr<NcclCommunicator>> comm = NcclCommunicator::create(*device_, *id, 0, 1);
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  EXPECT_EQ((*comm)->rank(), 0);
  EXPECT_EQ((*comm)->world(), 1);

  std::vector<unsigned char> host(kCount * esize);
  for (std::size_t i = 0; i < kCount; ++i) {
    const auto value = static_cast<float>(i % 251);  // an integer, exact in all three types
    if (dtype == DType::f32) {
      std::memcpy(&host[i * 4], &value, 4);
    } else {
      const std::uint16_t bits = dtype == DType::f16 ? float_to_f16(value) : float_to_bf16(value);
      std::memcpy(&host[i * 2], &bits, 2);
    }
  }
  std::vector<unsigned char> back(host.size());
  Result<void*> send = device_->allocate(host.size());
  Result<void*> recv = device_->allocate(host.size());
  ASSERT_TRUE(send.ok() && recv.ok());
  ASSERT_TRUE(device_->copy_to_device(*send, host.data(), host.size(), Stream::compute).ok());

  ASSERT_TRUE((*comm)->reduce_scatter(*send, *recv, kCount, dtype, Stream::compute).ok());
  ASSERT_TRUE(device_->copy_to_host(back.data(), *recv, back.size(), Stream::compute).ok());
  ASSERT_TRUE(device_->synchronize().ok());
  EXPECT_EQ(std::memcmp(host.data(), back.data(), host.size()), 0) << "reduce_scatter";

  std::memset(back.data(), 0, back.size());
  ASSERT_TRUE(device_->copy_to_device(*recv, back.data(), back.size(), Stream::compute).ok());
  // On another stream than the zeroing copy: ordered after it by an event.
  Result<EventId> zeroed = device_->record(Stream::compute);
  ASSERT_TRUE(zeroed.ok());
  ASSERT_TRUE(device_->wait(Stream::d2h, *zeroed).ok());
  ASSERT_TRUE((*comm)->all_gather(*send, *recv, kCount, dtype, Stream::d2h).ok());
  ASSERT_TRUE(device_->copy_to_host(back.data(), *recv, back.size(), Stream::d2h).ok());
  Result<EventId> gathered = device_->record(Stream::d2h);
  ASSERT_TRUE(gathered.ok());
  ASSERT_TRUE(device_->synchronize(*gathered).ok());
  EXPECT_EQ(std::memcmp(host.data(), back.data(), host.size()), 0) << "all_gather";
  comm->reset();
  device_->free(*recv);
  device_->free(*send);
}

#else

TEST_P(NcclTest, ReportsBuiltWithoutNccl) {
  Result<NcclUniqueId> id = NcclCommunicator::make_unique_id();
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), StatusCode::unsupported);
}

#endif

INSTANTIATE_TEST_SUITE_P(Dtypes, NcclTest, ::testing::Values(DType::f32, DType::f16, DType::bf16),
                         [](const ::testing::TestParamInfo<DType>& param) { return std::string(dtype_name(param.param)); });

}  // namespace
}  // namespace zoe::cuda
