// zoe::Collectives over NCCL on a CudaDevice: the partitioned optimizer's reduce-scatter and all-gather run
// on the device's streams; the host all-reduce of the gradient statistics goes through an all-gather of a
// few doubles, summed on the host in rank order so that every rank decides on the same bits.
#include <cstring>
#include <vector>

#include "cuda/nccl_comm.h"
#include "zoe/partition.h"

namespace zoe {
namespace {

class NcclCollectives final : public Collectives {
 public:
  NcclCollectives(cuda::CudaDevice& device, std::unique_ptr<cuda::NcclCommunicator> comm)
      : device_(device), comm_(std::move(comm)) {}
  ~NcclCollectives() override {
    device_.free(scratch_);
    device_.free_host(host_);
  }

  int rank() const override { return comm_->rank(); }
  int world() const override { return comm_->world(); }

  Status reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, Stream stream) override {
    return comm_->reduce_scatter(send, recv, count, dtype, stream);
  }
  Status all_gather(const void* send, void* recv, std::size_t count, DType dtype, Stream stream) override {
    return comm_->all_gather(send, recv, count, dtype, stream);
  }

  Status all_reduce_host(double* values, std::size_t count) override {
    const std::size_t bytes = count * sizeof(double), all = bytes * static_cast<std::size_t>(world());
    if (bytes == 0) return Status::success();
    if (all > capacity_) {
      device_.free(scratch_);
      device_.free_host(host_);
      scratch_ = host_ = nullptr;
      capacity_ = 0;
      Result<void*> d = device_.allocate(all);
      if (!d.ok()) return d.status();
      scratch_ = d.value();
      Result<void*> h = device_.allocate_host(all);
      if (!h.ok()) return h.status();
      host_ = h.value();
      capacity_ = all;
    }
    auto* mine = static_cast<unsigned char*>(scratch_) + bytes * static_cast<std::size_t>(rank());
    std::memcpy(host_, values, bytes);
    if (Status s = device_.copy_to_device(mine, host_, bytes, Stream::compute); !s.ok()) return s;
    // Doubles travel as pairs of f32 words: an all-gather only moves bits.
    if (Status s = comm_->all_gather(mine, scratch_, count * 2, DType::f32, Stream::compute); !s.ok()) return s;
    if (Status s = device_.copy_to_host(host_, scratch_, all, Stream::compute); !s.ok()) return s;
    Result<EventId> done = device_.record(Stream::compute);
    if (!done.ok()) return done.status();
    if (Status s = device_.synchronize(done.value()); !s.ok()) return s;
    const auto* gathered = static_cast<const double*>(host_);
    for (std::size_t i = 0; i < count; ++i) {
      double sum = 0;
      for (int r = 0; r < world(); ++r) sum += gathered[static_cast<std::size_t>(r) * count + i];
      values[i] = sum;
    }
    return Status::success();
  }

 private:
  cuda::CudaDevice& device_;
  std::unique_ptr<cuda::NcclCommunicator> comm_;
  void* scratch_ = nullptr;
  void* host_ = nullptr;
  std::size_t capacity_ = 0;
};

}  // namespace

Result<NcclUniqueId> make_nccl_unique_id() { return cuda::NcclCommunicator::make_unique_id(); }

Result<std::unique_ptr<Collectives>> make_nccl_collectives(Device& cuda_device, const NcclUniqueId& id, int rank,
                                                           int world) {
  auto* device = dynamic_cast<cuda::CudaDevice*>(&cuda_device);
  if (device == nullptr) {
    return invalid_argument("NCCL collectives need a CUDA device (make_cuda_device); got " + cuda_device.name());
  }
  Result<std::unique_ptr<cuda::NcclCommunicator>> comm = cuda::NcclCommunicator::create(*device, id, rank, world);
  if (!comm.ok()) return comm.status();
  return std::unique_ptr<Collectives>(std::make_unique<NcclCollectives>(*device, std::move(comm).value()));
}

}  // namespace zoe
