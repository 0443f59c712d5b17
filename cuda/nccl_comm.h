// NCCL collectives on a CudaDevice's streams: the ZeRO data-parallel exchange (gradients reduce-scattered
// to the rank that owns their optimizer state, updated weights all-gathered back). Built without NCCL,
// create() and make_unique_id() return unsupported.
#pragma once

#include "cuda/private.h"

#include <array>
#include <cstddef>
#include <memory>

#include "cuda/cuda_device.h"
#include "zoe/dtype.h"
#include "zoe/status.h"

struct ncclComm;  // nccl.h's opaque communicator, so that this header does not need NCCL

namespace zoe::cuda {

using NcclUniqueId = std::array<char, 128>;  // ncclUniqueId's bytes, passed between ranks by the caller

class NcclCommunicator {
 public:
  // Made by one rank (say rank 0) and sent to all the others before create().
  static Result<NcclUniqueId> make_unique_id();
  // Joins rank `rank` of `world` on `device`; blocks until every rank has joined. The device must outlive
  // the communicator. Collectives run on the device's streams.
  static Result<std::unique_ptr<NcclCommunicator>> create(CudaDevice& device, const NcclUniqueId& unique_id,
                                                          int rank, int world);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // recv (recv_count elements) = the sum over ranks of send[rank * recv_count, (rank + 1) * recv_count).
  // A sum, not a mean: the caller scales (for example folding 1/world into the loss scale).
  Status reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype, Stream stream);
  // recv (world * send_count elements) = every rank's send, in rank order.
  Status all_gather(const void* send, void* recv, std::size_t send_count, DType dtype, Stream stream);

  int rank() const { return rank_; }
  int world() const { return world_; }

 private:
  NcclCommunicator(CudaDevice& device, ncclComm* comm, int rank, int world)
      : device_(device), comm_(comm), rank_(rank), world_(world) {}
  Status check_call(const char* call, const void* send, void* recv, std::size_t count, DType dtype,
                    Stream stream) const;

  CudaDevice& device_;
  ncclComm* comm_;
  int rank_;
  int world_;
};

}  // namespace zoe::cuda
