// In-process collectives: `world` ranks in one process, each a thread with its own host stand-in device.
// A collective runs on the calling rank's stream; the ranks meet at a barrier, each publishes its buffer,
// each computes its own result from everybody's buffers, and they meet again before anyone may reuse them.
// Sums run in rank order in float and round once to the dtype, so every rank and every run gets the same bits.
#include <barrier>
#include <cstring>
#include <mutex>
#include <vector>

#include "zoe/host_device.h"
#include "zoe/partition.h"

namespace zoe {

class HostGroup {
 public:
  explicit HostGroup(int ranks) : world(ranks), barrier(ranks), sends(ranks), values(ranks) {}

  const int world;
  std::barrier<> barrier;
  std::vector<const void*> sends;
  std::vector<std::vector<double>> values;
};

namespace {

float load(const void* base, std::size_t i, DType dtype) {
  if (dtype == DType::f32) return static_cast<const float*>(base)[i];
  const std::uint16_t h = static_cast<const std::uint16_t*>(base)[i];
  return dtype == DType::f16 ? f16_to_float(h) : bf16_to_float(h);
}

void store(void* base, std::size_t i, DType dtype, float x) {
  if (dtype == DType::f32) {
    static_cast<float*>(base)[i] = x;
  } else {
    static_cast<std::uint16_t*>(base)[i] = dtype == DType::f16 ? float_to_f16(x) : float_to_bf16(x);
  }
}

class HostCollectives final : public Collectives {
 public:
  HostCollectives(std::shared_ptr<HostGroup> group, Device& device, int rank)
      : group_(std::move(group)), device_(device), rank_(rank) {}

  int rank() const override { return rank_; }
  int world() const override { return group_->world; }

  Status reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, Stream stream) override {
    if (!dtype_valid(dtype)) return invalid_argument("reduce_scatter: invalid dtype");
    return enqueue_on_host_device(device_, stream, [this, send, recv, count, dtype] {
      HostGroup& g = *group_;
      g.sends[rank_] = send;
      g.barrier.arrive_and_wait();
      const std::size_t first = static_cast<std::size_t>(rank_) * count;
      for (std::size_t i = 0; i < count; ++i) {
        float sum = 0;
        for (int r = 0; r < g.world; ++r) sum += load(g.sends[r], first + i, dtype);
        store(recv, i, dtype, sum);
      }
      g.barrier.arrive_and_wait();
    });
  }

  Status all_gather(const void* send, void* recv, std::size_t count, DType dtype, Stream stream) override {
    if (!dtype_valid(dtype)) return invalid_argument("all_gather: invalid dtype");
    return enqueue_on_host_device(device_, stream, [this, send, recv, count, dtype] {
      HostGroup& g = *group_;
      const std::size_t bytes = count * dtype_size(dtype);
      g.sends[rank_] = send;
      g.barrier.arrive_and_wait();
      // Each rank writes only its own recv; a rank's send (possibly inside its recv) is read, never written.
      for (int r = 0; r < g.world; ++r) {
        void* to = static_cast<unsigned char*>(recv) + static_cast<std::size_t>(r) * bytes;
        if (to != g.sends[r]) std::memcpy(to, g.sends[r], bytes);
      }
      g.barrier.arrive_and_wait();
    });
  }

  Status all_reduce_host(double* values, std::size_t count) override {
    HostGroup& g = *group_;
    g.values[rank_].assign(values, values + count);
    g.barrier.arrive_and_wait();
    for (std::size_t i = 0; i < count; ++i) {
      double sum = 0;
      for (int r = 0; r < g.world; ++r) sum += g.values[r][i];
      values[i] = sum;
    }
    g.barrier.arrive_and_wait();
    return Status::success();
  }

 private:
  std::shared_ptr<HostGroup> group_;
  Device& device_;
  int rank_;
};

}  // namespace

std::shared_ptr<HostGroup> make_host_group(int world) {
  return world >= 1 ? std::make_shared<HostGroup>(world) : nullptr;
}

Result<std::unique_ptr<Collectives>> make_host_collectives(std::shared_ptr<HostGroup> group, Device& host_device,
                                                           int rank) {
  if (!group) return invalid_argument("host collectives: no group (make_host_group needs world >= 1)");
  if (rank < 0 || rank >= group->world) {
    return invalid_argument("host collectives: rank " + std::to_string(rank) + " is not in a group of " +
                            std::to_string(group->world));
  }
  // A probe that the device is a host stand-in, before any rank waits at a barrier for this one.
  if (Status s = enqueue_on_host_device(host_device, Stream::compute, [] {}); !s.ok()) return s;
  return std::unique_ptr<Collectives>(std::make_unique<HostCollectives>(std::move(group), host_device, rank));
}

}  // namespace zoe
