// ZeRO data-parallel partitioning: W ranks, each owning the optimizer state of 1/W of the flattened
// parameters. Gradients are reduce-scattered on the device before they come down, updated weights are
// all-gathered on the device after they go up. Collectives is one rank's view of the group, working on its
// device's streams: NCCL on GPUs, or in-process ranks on host stand-in devices (tests, machines without GPUs).
#pragma once

#include <array>
#include <cstddef>
#include <memory>

#include "zoe/device.h"
#include "zoe/dtype.h"
#include "zoe/status.h"

namespace zoe {

class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // recv (count elements) = the sum over ranks of their send[rank * count, (rank + 1) * count), in
  // `dtype`. Enqueued on `stream` of this rank's device.
  virtual Status reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, Stream stream) = 0;
  // recv (world * count elements) = every rank's send, in rank order. send may be recv + rank * count.
  virtual Status all_gather(const void* send, void* recv, std::size_t count, DType dtype, Stream stream) = 0;
  // values[0, count) summed over ranks, in rank order (so every rank gets the same bits). Blocks the host.
  virtual Status all_reduce_host(double* values, std::size_t count) = 0;
};

// NCCL: rank 0 makes the unique id and the caller sends it to every rank (as torch.distributed does with
// its store); each rank then joins with its CUDA device (make_cuda_device). Unsupported without NCCL.
using NcclUniqueId = std::array<char, 128>;
Result<NcclUniqueId> make_nccl_unique_id();
Result<std::unique_ptr<Collectives>> make_nccl_collectives(Device& cuda_device, const NcclUniqueId& id, int rank,
                                                           int world);

// In-process ranks: one HostGroup shared by `world` threads, each with its own host stand-in device.
class HostGroup;
std::shared_ptr<HostGroup> make_host_group(int world);
Result<std::unique_ptr<Collectives>> make_host_collectives(std::shared_ptr<HostGroup> group, Device& host_device,
                                                           int rank);

}  // namespace zoe
