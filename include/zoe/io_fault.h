// Fault injection for file I/O (tests): the I/O layer (aio/) asks a hook at each site of a swap store's or
// a parameter tier's files, so that a test can make any open, allocation, read, write or sync fail as the
// OS would.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>

namespace zoe {

// A non-zero error makes the operation fail with that errno as if the OS had said so; for read/write the hook
// runs when the request completes (the transfer really happened), so a reported failure leaves bytes on
// disk that must not be trusted — exactly what a real failed write can leave. With several requests in flight
// it runs in the order the kernel completes them, not the order they were submitted: a test that means one
// request names it by its offset.
enum class IoOp : std::uint8_t { open, allocate, read, write, sync };
std::string_view io_op_name(IoOp op);

struct IoSite {
  IoOp op = IoOp::read;
  std::string_view path;
  std::uint64_t offset = 0;  // read/write: file offset of the request
  std::uint64_t bytes = 0;   // read/write: request length; allocate: file size asked
  std::uint64_t index = 0;   // read/write: 0-based count of earlier requests of this op in this store
  bool direct = false;       // open: whether O_DIRECT is being asked for
};

struct IoFault {
  int error = 0;                   // errno to report (EIO, ENOSPC, EROFS, EINVAL, ...); 0: no error
  std::int64_t transferred = -1;   // read/write without error: report this many bytes (short transfer); -1: real
};

using IoFaultHook = std::function<IoFault(const IoSite&)>;

}  // namespace zoe
