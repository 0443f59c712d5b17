// CudaDevice against the zoe::Device contract. Every GPU test first queries the GPUs and skips with the
// reason when there is none; without a GPU, only the "unsupported" answer of make_cuda_device is checked.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_device.h"
#include "cuda/device.h"
#include "zoe/device.h"
#include "zoe/dtype.h"

namespace zoe::cuda {
namespace {

// The device adds exact fp64 squares (all >= 0) in another order than the long double reference: the
// relative error is at most (n - 1) * 2^-53, 1.1e-10 for the largest n here.
constexpr double kSumRelTol = 2e-10;
constexpr double kSumAbsTol = 0;
constexpr Stream kAllStreams[] = {Stream::compute, Stream::d2h, Stream::h2d};

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<DeviceQuery> query = query_devices();
    ASSERT_TRUE(query.ok()) << query.status().to_string();
    if (query->count == 0) GTEST_SKIP() << query->reason;
    Result<std::unique_ptr<CudaDevice>> created = CudaDevice::create(0);
    ASSERT_TRUE(created.ok()) << created.status().to_string();
    device_ = std::move(created).value();
  }

  void* device_buffer(std::size_t bytes) {
    Result<void*> ptr = device_->allocate(bytes);
    EXPECT_TRUE(ptr.ok()) << ptr.status().to_string();
    return ptr.ok() ? *ptr : nullptr;
  }
  void* host_buffer(std::size_t bytes) {
    Result<void*> ptr = device_->allocate_host(bytes);
    EXPECT_TRUE(ptr.ok()) << ptr.status().to_string();
    return ptr.ok() ? *ptr : nullptr;
  }
  void sync_stream(Stream stream) {
    Result<EventId> event = device_->record(stream);
    ASSERT_TRUE(event.ok()) << event.status().to_string();
    ASSERT_TRUE(device_->synchronize(*event).ok());
  }

  std::unique_ptr<CudaDevice> device_;
};

TEST(CudaDeviceNoGpu, MakeReportsUnsupported) {
  Result<DeviceQuery> query = query_devices();
  ASSERT_TRUE(query.ok()) << query.status().to_string();
  if (query->count > 0) GTEST_SKIP() << "a GPU is present (" << query->first_name << "); this checks machines without";
  Result<std::unique_ptr<Device>> device = make_cuda_device(0);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::unsupported) << device.status().to_string();
}

TEST_F(CudaDeviceTest, NameAndBadOrdinal) {
  EXPECT_EQ(device_->name().rfind("cuda:0 (", 0), 0u) << device_->name();
  Result<std::unique_ptr<Device>> missing = make_cuda_device(1 << 20);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::invalid_argument);
}

TEST_F(CudaDeviceTest, AllocateAndFree) {
  void* ptr = device_buffer(1 << 20);
  ASSERT_NE(ptr, nullptr);
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, ptr), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
  device_->free(ptr);
  Result<void*> empty = device_->allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, nullptr);
  device_->free(nullptr);
}

long rss_kib() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmRSS:") {
      long kib = 0;
      status >> kib;
      return kib;
    }
    status.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return -1;
}

// Pinned, usable to its last byte, and not rounded up to a power of two: 5 MiB + 5 bytes would be 8 MiB
// there. Pinning faults every page in, so resident memory grows by about the page-rounded size.
TEST_F(CudaDeviceTest, HostAllocationIsPinnedAndExactSize) {
  device_->free_host(host_buffer(4096));  // first registration's own overhead out of the measurement
  for (std::size_t bytes : {std::size_t{1}, std::size_t{4097}, (std::size_t{5} << 20) + 5}) {
    const long before = rss_kib();
    auto* ptr = static_cast<unsigned char*>(host_buffer(bytes));
    ASSERT_NE(ptr, nullptr);
    const long grown_kib = rss_kib() - before;
    for (const unsigned char* p : {ptr, ptr + bytes - 1}) {
      cudaPointerAttributes attributes{};
      ASSERT_EQ(cudaPointerGetAttributes(&attributes, p), cudaSuccess);
      EXPECT_EQ(attributes.type, cudaMemoryTypeHost) << bytes << " bytes";
    }
    std::memset(ptr, 0xA5, bytes);
    EXPECT_EQ(ptr[bytes - 1], 0xA5);
    if (bytes > (std::size_t{4} << 20)) {
      EXPECT_LT(grown_kib, static_cast<long>((bytes >> 10) + 1024)) << "resident memory grew by " << grown_kib << " KiB";
    }
    device_->free_host(ptr);
  }
  Result<void*> empty = device_->allocate_host(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, nullptr);
}

TEST_F(CudaDeviceTest, CopyRoundTripOnEveryStream) {
  constexpr std::size_t kBytes = (std::size_t{3} << 20) + 7;
  auto* src = static_cast<unsigned char*>(host_buffer(kBytes));
  auto* dst = static_cast<unsigned char*>(host_buffer(kBytes));
  void* dev = device_buffer(kBytes);
  ASSERT_TRUE(src && dst && dev);
  for (Stream stream : kAllStreams) {
    for (std::size_t i = 0; i < kBytes; ++i) src[i] = static_cast<unsigned char>(i * 131 + static_cast<int>(stream));
    std::memset(dst, 0, kBytes);
    ASSERT_TRUE(device_->copy_to_device(dev, src, kBytes, stream).ok());
    Result<EventId> uploaded = device_->record(stream);
    ASSERT_TRUE(uploaded.ok());
    ASSERT_TRUE(device_->copy_to_host(dst, dev, kBytes, stream).ok());
    Result<EventId> downloaded = device_->record(stream);
    ASSERT_TRUE(downloaded.ok());
    EXPECT_GT(*downloaded, *uploaded);
    ASSERT_TRUE(device_->synchronize(*downloaded).ok());
    EXPECT_TRUE(device_->synchronize(*uploaded).ok());  // completed earlier on the same stream
    EXPECT_EQ(std::memcmp(src, dst, kBytes), 0) << "stream " << static_cast<int>(stream);
  }
  device_->free(dev);
  device_->free_host(dst);
  device_->free_host(src);
}

// The d2h copy must see the compute stream's upload, which runs only after a long simulated compute:
// without the wait it would read the old contents.
TEST_F(CudaDeviceTest, WaitOrdersStreams) {
  constexpr std::size_t kBytes = 1 << 20;
  auto* old_data = static_cast<unsigned char*>(host_buffer(kBytes));
  auto* new_data = static_cast<unsigned char*>(host_buffer(kBytes));
  auto* seen = static_cast<unsigned char*>(host_buffer(kBytes));
  void* dev = device_buffer(kBytes);
  ASSERT_TRUE(old_data && new_data && seen && dev);
  std::memset(old_data, 1, kBytes);
  std::memset(new_data, 2, kBytes);
  ASSERT_TRUE(device_->copy_to_device(dev, old_data, kBytes, Stream::h2d).ok());
  sync_stream(Stream::h2d);

  ASSERT_TRUE(device_->simulate_compute(0.2, Stream::compute).ok());
  ASSERT_TRUE(device_->copy_to_device(dev, new_data, kBytes, Stream::compute).ok());
  Result<EventId> written = device_->record(Stream::compute);
  ASSERT_TRUE(written.ok());
  ASSERT_TRUE(device_->wait(Stream::d2h, *written).ok());
  ASSERT_TRUE(device_->copy_to_host(seen, dev, kBytes, Stream::d2h).ok());
  sync_stream(Stream::d2h);
  EXPECT_EQ(seen[0], 2);
  EXPECT_EQ(seen[kBytes - 1], 2);

  ASSERT_TRUE(device_->synchronize(*written).ok());
  EXPECT_TRUE(device_->wait(Stream::h2d, *written).ok()) << "a released event has completed: waiting is a no-op";
  device_->free(dev);
  device_->free_host(seen);
  device_->free_host(new_data);
  device_->free_host(old_data);
}

// torch's current stream as Stream::compute: zoe's events there mark the caller's kernels, its waits hold
// the caller's later kernels, and the host waits for none of it.
TEST_F(CudaDeviceTest, ForeignComputeStreamOrdersWithoutHostWaits) {
  cudaStream_t foreign = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&foreign, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_TRUE(device_->use_compute_stream(reinterpret_cast<std::uintptr_t>(foreign)).ok());
  constexpr std::size_t kBytes = 1 << 20;
  auto* later = static_cast<unsigned char*>(host_buffer(kBytes));
  auto* seen = static_cast<unsigned char*>(host_buffer(kBytes));
  void* dev = device_buffer(kBytes);
  ASSERT_TRUE(later && seen && dev);
  std::memset(later, 7, kBytes);
  ASSERT_TRUE(device_->fill_zero(dev, kBytes, Stream::h2d).ok());
  sync_stream(Stream::h2d);
  const HostWaits before = device_->host_waits();

  // The caller's kernel (a spin) then its write, both on its own stream; zoe's copy waits for them on the device.
  ASSERT_TRUE(device_->simulate_compute(0.2, Stream::compute).ok());
  ASSERT_EQ(cudaMemcpyAsync(dev, later, kBytes, cudaMemcpyHostToDevice, foreign), cudaSuccess);
  const auto start = std::chrono::steady_clock::now();
  Result<EventId> produced = device_->record(Stream::compute);
  ASSERT_TRUE(produced.ok());
  ASSERT_TRUE(device_->wait(Stream::d2h, *produced).ok());
  ASSERT_TRUE(device_->copy_to_host(seen, dev, kBytes, Stream::d2h).ok());
  Result<EventId> copied = device_->record(Stream::d2h);
  ASSERT_TRUE(copied.ok());
  // The caller's next kernel must not overwrite the buffer before zoe's copy has read it.
  ASSERT_TRUE(device_->wait(Stream::compute, *copied).ok());
  ASSERT_EQ(cudaMemsetAsync(dev, 9, kBytes, foreign), cudaSuccess);
  const double enqueued = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(cudaStreamQuery(foreign), cudaErrorNotReady) << "the spin must run on the foreign stream";
  EXPECT_LT(enqueued, 0.1) << "record and wait on the foreign stream must not block the host";
  EXPECT_EQ(device_->host_waits().trainer_calls, before.trainer_calls);

  ASSERT_EQ(cudaStreamSynchronize(foreign), cudaSuccess);
  sync_stream(Stream::d2h);
  EXPECT_EQ(seen[0], 7) << "zoe copied before the caller's write";
  EXPECT_EQ(seen[kBytes - 1], 7) << "zoe copied before the caller's write, or after its next one";
  // The d2h stream may be done by now: a synchronize that finds its work complete is not a wait.
  const HostWaits after = device_->host_waits();
  EXPECT_LE(after.trainer_calls, before.trainer_calls + 1) << "at most the one synchronize of this test's thread";
  EXPECT_EQ(after.worker_calls, before.worker_calls);

  ASSERT_TRUE(device_->use_compute_stream(std::nullopt).ok());
  device_->free(dev);
  device_->free_host(seen);
  device_->free_host(later);
  ASSERT_EQ(cudaStreamDestroy(foreign), cudaSuccess);
}

TEST_F(CudaDeviceTest, SimulateComputeTakesAtLeastTheRequestedTime) {
  ASSERT_TRUE(device_->simulate_compute(0.001, Stream::compute).ok());  // loads the module
  ASSERT_TRUE(device_->synchronize().ok());
  constexpr double kSeconds = 0.1;
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(device_->simulate_compute(kSeconds, Stream::compute).ok());
  const double enqueued = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(device_->synchronize().ok());
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(enqueued, kSeconds / 2) << "simulate_compute must not block the host";
  EXPECT_GE(elapsed, kSeconds);
  EXPECT_EQ(device_->simulate_compute(-1, Stream::compute).code(), StatusCode::invalid_argument);
  EXPECT_EQ(device_->simulate_compute(std::nan(""), Stream::compute).code(), StatusCode::invalid_argument);
}

TEST_F(CudaDeviceTest, RejectsBadArguments) {
  EXPECT_EQ(device_->wait(Stream::compute, 0).code(), StatusCode::invalid_argument);
  EXPECT_EQ(device_->wait(Stream::compute, 1u << 30).code(), StatusCode::invalid_argument);
  EXPECT_EQ(device_->synchronize(EventId{1} << 40).code(), StatusCode::invalid_argument);
  EXPECT_FALSE(device_->record(static_cast<Stream>(7)).ok());
  void* dev = device_buffer(64);
  GradStats stats;
  EXPECT_EQ(device_->grad_stats(static_cast<char*>(dev) + 1, DType::f16, 4, &stats, Stream::compute).code(),
            StatusCode::invalid_argument);
  EXPECT_EQ(device_->grad_stats(dev, static_cast<DType>(9), 4, &stats, Stream::compute).code(),
            StatusCode::invalid_argument);
  EXPECT_EQ(device_->grad_stats(dev, DType::f32, 4, nullptr, Stream::compute).code(), StatusCode::invalid_argument);
  device_->free(dev);
}

// Many records with no synchronize: completed events are recycled, and their ids still read as complete.
TEST_F(CudaDeviceTest, ManyEventsWithoutSynchronize) {
  std::vector<EventId> ids;
  for (int i = 0; i < 5000; ++i) {
    Result<EventId> event = device_->record(kAllStreams[i % kStreams]);
    ASSERT_TRUE(event.ok()) << event.status().to_string();
    ids.push_back(*event);
  }
  ASSERT_TRUE(device_->synchronize().ok());
  for (EventId id : ids) ASSERT_TRUE(device_->wait(Stream::compute, id).ok());
  for (EventId id : ids) ASSERT_TRUE(device_->synchronize(id).ok());
}


enum class Fill { finite, large, inf, nan };

// Gradients of `dtype` as stored, and the reference computed from the stored values.
struct HostGrads {
  std::vector<unsigned char> bytes;
  long double sum_sq = 0;
  std::uint64_t non_finite = 0;
};

HostGrads make_grads(DType dtype, std::size_t n, Fill fill, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  // Finite in f32 and bf16 but with a square beyond fp32's range; f16 tops out at 65504.
  const float large = dtype == DType::f16 ? 6.0e4f : 1.0e30f;
  HostGrads grads;
  grads.bytes.resize(n * dtype_size(dtype));
  for (std::size_t i = 0; i < n; ++i) {
    float value = dist(rng);
    if (i % 97 == 5) {
      if (fill == Fill::large) value = large;
      if (fill == Fill::inf) value = i % 2 ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
      if (fill == Fill::nan) value = std::numeric_limits<float>::quiet_NaN();
    }
    float stored = value;
    if (dtype == DType::f32) {
      std::memcpy(&grads.bytes[i * 4], &value, 4);
    } else {
      const std::uint16_t bits = dtype == DType::f16 ? float_to_f16(value) : float_to_bf16(value);
      std::memcpy(&grads.bytes[i * 2], &bits, 2);
      stored = dtype == DType::f16 ? f16_to_float(bits) : bf16_to_float(bits);
    }
    if (!std::isfinite(stored)) ++grads.non_finite;
    grads.sum_sq += static_cast<long double>(stored) * stored;
  }
  return grads;
}

void expect_stats(const GradStats& got, const HostGrads& want, const std::string& label) {
  EXPECT_EQ(got.non_finite, want.non_finite) << label;
  const auto sum = static_cast<double>(want.sum_sq);
  if (std::isnan(sum)) {
    EXPECT_TRUE(std::isnan(got.sum_sq)) << label << ": got " << got.sum_sq;
  } else if (std::isinf(sum)) {
    EXPECT_EQ(got.sum_sq, sum) << label;
  } else {
    EXPECT_NEAR(got.sum_sq, sum, kSumAbsTol + kSumRelTol * sum) << label;
  }
}

class GradStatsTest : public CudaDeviceTest, public ::testing::WithParamInterface<DType> {};

// Sizes around the 16-byte vector, element offsets that leave a head before the first 16-byte boundary, a
// size spanning more than the 1024 x 256 threads of one grid pass, and each kind of special value.
TEST_P(GradStatsTest, MatchesHostReference) {
  const DType dtype = GetParam();
  const std::size_t esize = dtype_size(dtype);
  constexpr std::size_t kMaxN = 1000003;
  constexpr std::size_t kMaxOffset = 3;
  void* dev = device_buffer((kMaxN + kMaxOffset) * esize);
  ASSERT_NE(dev, nullptr);
  int calls = 0;
  for (std::size_t n : {0, 1, 7, 8, 9, 33, 4099, 300007, 1000003}) {
    for (std::size_t offset : {0, 1, 3}) {
      for (Fill fill : {Fill::finite, Fill::large, Fill::inf, Fill::nan}) {
        const std::string label = std::string(dtype_name(dtype)) + " n=" + std::to_string(n) +
                                  " offset=" + std::to_string(offset) + " fill=" + std::to_string(int(fill));
        const HostGrads grads = make_grads(dtype, n, fill, static_cast<std::uint32_t>(n * 31 + offset));
        const Stream stream = kAllStreams[calls++ % kStreams];
        void* at = static_cast<char*>(dev) + offset * esize;
        ASSERT_TRUE(device_->copy_to_device(at, grads.bytes.data(), grads.bytes.size(), stream).ok()) << label;
        GradStats first{-1.0, 99};
        GradStats second{-1.0, 99};
        ASSERT_TRUE(device_->grad_stats(at, dtype, n, &first, stream).ok()) << label;
        ASSERT_TRUE(device_->grad_stats(at, dtype, n, &second, stream).ok()) << label;
        sync_stream(stream);
        expect_stats(first, grads, label);
        EXPECT_EQ(std::memcmp(&first.sum_sq, &second.sum_sq, sizeof(double)), 0) << label << ": not deterministic";
        EXPECT_EQ(first.non_finite, second.non_finite) << label;
      }
    }
  }
  device_->free(dev);
}

// More calls in flight than one chunk of result slots, from one thread per stream at once: each call fills
// its own *out.
TEST_P(GradStatsTest, ConcurrentQueuedCallsFillTheirOwnResults) {
  const DType dtype = GetParam();
  constexpr std::size_t kN = 20000;
  constexpr std::size_t kCalls = 150;
  const HostGrads grads = make_grads(dtype, kN, Fill::finite, 7);
  void* dev = device_buffer(grads.bytes.size());
  ASSERT_NE(dev, nullptr);
  ASSERT_TRUE(device_->copy_to_device(dev, grads.bytes.data(), grads.bytes.size(), Stream::h2d).ok());
  sync_stream(Stream::h2d);
  // Call i covers the first kN - i * 100 elements; its reference is the matching prefix.
  std::vector<HostGrads> want;
  for (std::size_t i = 0; i < kCalls; ++i) want.push_back(make_grads(dtype, kN - i * 100, Fill::finite, 7));
  std::vector<std::vector<GradStats>> got(kStreams, std::vector<GradStats>(kCalls));
  std::vector<std::thread> threads;
  std::vector<int> failures(kStreams, 0);
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      for (std::size_t i = 0; i < kCalls; ++i) {
        if (!device_->grad_stats(dev, dtype, kN - i * 100, &got[s][i], kAllStreams[s]).ok()) ++failures[s];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  ASSERT_TRUE(device_->synchronize().ok());
  for (int s = 0; s < kStreams; ++s) {
    EXPECT_EQ(failures[s], 0);
    for (std::size_t i = 0; i < kCalls; ++i) expect_stats(got[s][i], want[i], "stream " + std::to_string(s) + " call " + std::to_string(i));
  }
  device_->free(dev);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GradStatsTest, ::testing::Values(DType::f32, DType::f16, DType::bf16),
                         [](const ::testing::TestParamInfo<DType>& param) { return std::string(dtype_name(param.param)); });

}  // namespace
}  // namespace zoe::cuda
