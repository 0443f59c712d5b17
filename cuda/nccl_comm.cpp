#include "cuda/nccl_comm.h"

#include <algorithm>
#include <iterator>
#include <new>
#include <string>
#include <utility>

#ifdef ZOE_HAVE_NCCL
#include <nccl.h>
#endif

namespace zoe::cuda {

#ifdef ZOE_HAVE_NCCL

static_assert(sizeof(ncclUniqueId) == sizeof(NcclUniqueId), "NcclUniqueId must hold ncclUniqueId exactly");

namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i8: break;  // moment codes never go through collectives
  }
  return ncclFloat32;  // unreachable: callers validate dtype first
}

StatusCode code_of(ncclResult_t result) {
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage: return StatusCode::invalid_argument;
    case ncclSystemError: return StatusCode::io_error;
    default: return StatusCode::internal;
  }
}

// ncclGetLastError names the cause (a peer, a socket, a CUDA call) where ncclGetErrorString has only the class;
// NCCL keeps only the last one, so it may belong to an earlier failure.
Status nccl_error(ncclResult_t result, const std::string& what, ncclComm_t comm) {
  std::string message = what + " failed: " + ncclGetErrorString(result);
  const char* detail = ncclGetLastError(comm);
  if (detail != nullptr && detail[0] != '\0') message += std::string(" (NCCL's last error: ") + detail + ")";
  return Status(code_of(result), std::move(message));
}

}  // namespace

Result<NcclUniqueId> NcclCommunicator::make_unique_id() {
  ncclUniqueId id{};
  const ncclResult_t result = ncclGetUniqueId(&id);
  if (result != ncclSuccess) return nccl_error(result, "ncclGetUniqueId", nullptr);
  NcclUniqueId bytes{};
  std::copy(std::begin(id.internal), std::end(id.internal), bytes.begin());
  return bytes;
}

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(CudaDevice& device,
                                                                    const NcclUniqueId& unique_id, int rank,
                                                                    int world) {
  if (world < 1 || rank < 0 || rank >= world) {
    return invalid_argument("NCCL communicator: rank " + std::to_string(rank) + " is not in a world of " +
                            std::to_string(world));
  }
  // ncclCommInitRank binds the communicator to the calling thread's current device.
  if (Status st = device.make_current(); !st.ok()) return st;
  ncclUniqueId id{};
  std::copy(unique_id.begin(), unique_id.end(), std::begin(id.internal));
  ncclComm_t comm = nullptr;
  const ncclResult_t result = ncclCommInitRank(&comm, world, id, rank);
  if (result != ncclSuccess) {
    return nccl_error(result, "ncclCommInitRank (rank " + std::to_string(rank) + " of " + std::to_string(world) + ")",
                      nullptr);
  }
  std::unique_ptr<NcclCommunicator> communicator(new (std::nothrow) NcclCommunicator(device, comm, rank, world));
  if (!communicator) {
    ncclCommDestroy(comm);
    return Status(StatusCode::out_of_memory, "out of host memory while creating the NCCL communicator");
  }
  return Result<std::unique_ptr<NcclCommunicator>>(std::move(communicator));
}

NcclCommunicator::~NcclCommunicator() {
  // Errors are ignored: nothing can report them. Collectives still queued finish first (ncclCommDestroy
  // finalizes a communicator that was not finalized).
  (void)device_.make_current();
  ncclCommDestroy(comm_);
}

Status NcclCommunicator::check_call(const char* call, const void* send, void* recv, std::size_t count,
                                    DType dtype, Stream stream) const {
  if (!dtype_valid(dtype)) return invalid_argument(std::string(call) + ": invalid dtype");
  if (device_.cuda_stream(stream) == nullptr) return invalid_argument(std::string(call) + ": invalid stream");
  if (count > 0 && (send == nullptr || recv == nullptr)) {
    return invalid_argument(std::string(call) + ": null buffer for " + std::to_string(count) + " elements");
  }
  return device_.make_current();
}

Status NcclCommunicator::reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                                        Stream stream) {
  if (Status st = check_call("reduce_scatter", send, recv, recv_count, dtype, stream); !st.ok()) return st;
  const ncclResult_t result =
      ncclReduceScatter(send, recv, recv_count, nccl_type(dtype), ncclSum, comm_, device_.cuda_stream(stream));
  if (result != ncclSuccess) return nccl_error(result, "ncclReduceScatter", comm_);
  return {};
}

Status NcclCommunicator::all_gather(const void* send, void* recv, std::size_t send_count, DType dtype,
                                    Stream stream) {
  if (Status st = check_call("all_gather", send, recv, send_count, dtype, stream); !st.ok()) return st;
  const ncclResult_t result =
      ncclAllGather(send, recv, send_count, nccl_type(dtype), comm_, device_.cuda_stream(stream));
  if (result != ncclSuccess) return nccl_error(result, "ncclAllGather", comm_);
  return {};
}

#else  // built without NCCL

namespace {
Status no_nccl() {
  return Status(StatusCode::unsupported, "zoe was built without NCCL (nccl.h and libnccl not found at configure time)");
}
}  // namespace

Result<NcclUniqueId> NcclCommunicator::make_unique_id() { return no_nccl(); }

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(CudaDevice&, const NcclUniqueId&, int, int) {
  return no_nccl();
}

// Never constructed without NCCL; defined so that the class links.
NcclCommunicator::~NcclCommunicator() = default;
Status NcclCommunicator::check_call(const char*, const void*, void*, std::size_t, DType, Stream) const {
  return no_nccl();
}
Status NcclCommunicator::reduce_scatter(const void*, void*, std::size_t, DType, Stream) { return no_nccl(); }
Status NcclCommunicator::all_gather(const void*, void*, std::size_t, DType, Stream) { return no_nccl(); }

#endif

}  // namespace zoe::cuda
