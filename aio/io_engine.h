// The libaio I/O engine: transfers ("jobs") of any aligned length against registered files, cut into
// requests of `request_bytes`, with at most `queue_depth` requests in the kernel at once across all files.
// A reaper thread collects completions and refills the queue, so the disk stays busy while the caller
// computes. Every completion is checked: an error or a short transfer fails its job with a Status naming
// the file, offset and length; the job's remaining requests are not issued.
#pragma once

#include "aio/private.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "zoe/status.h"
#include "zoe/io_fault.h"

namespace zoe::aio {

struct EngineOptions {
  unsigned queue_depth = 8;
  std::size_t request_bytes = 1 << 20;  // a multiple of alignment
  std::size_t alignment = 4096;         // file offsets, lengths and buffer addresses must be multiples of it
  IoFaultHook fault_hook;
};

// Busy time: wall seconds with at least one request of that kind in the kernel.
struct EngineCounters {
  std::uint64_t read_bytes = 0, write_bytes = 0;
  double read_busy_s = 0, write_busy_s = 0;
};

class IoEngine {
 public:
  using Ticket = std::uint64_t;

  static Result<std::unique_ptr<IoEngine>> create(const EngineOptions& options);
  ~IoEngine();  // waits for every request in flight: buffers may be freed only after
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Registers an open file (not owned; it must outlive the engine's use of it). Returns its index.
  int add_file(int fd, std::string path);
  const std::string& file_path(int file) const;

  // Queues a transfer of `bytes` between `buffer` and file offset `offset`. Alignment is checked here,
  // before anything reaches the kernel. The buffer must stay untouched until wait(ticket) returns.
  Result<Ticket> submit(IoOp op, int file, std::uint64_t offset, void* buffer, std::size_t bytes);
  // Blocks until the job is complete and returns its result; each ticket is waited exactly once.
  Status wait(Ticket ticket);
  // Waits for every job not waited yet (after a failure, before buffers are reused) and returns the first
  // error among them.
  Status wait_all();

  EngineCounters counters() const;
  void reset_counters();
  const EngineOptions& options() const;

 private:
  struct Impl;
  explicit IoEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoe::aio
