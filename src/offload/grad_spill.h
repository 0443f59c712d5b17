// Tier nvme's gradient spill (OffloadOptions::spill_grads): each parameter's gradient goes to a file beside
// the swap store as soon as it is reported, and the streamed step (step_windows.h) reads it back window by
// window. Neither the device nor host RAM holds the iteration's gradients then — what ZeRO-Infinity does with
// gradient partitions, and what lets a model whose 16-bit gradients alone exceed the GPUs' memory and the
// host's (a trillion parameters on one DGX-2: 2 TB of them) train at all.
//
// The file, `<store name>.grads` on the first NVMe path, holds each parameter's gradient in its own dtype from a
// 4096-byte boundary (one O_DIRECT write per bounce of it; the tail's padding is the parameter's own), one copy:
// a gradient lives for one iteration, and a crash loses nothing the next run needs. The store's owner lock
// (`<store name>.lock`) covers the name, so no other optimizer writes it. Two bounce buffers of device-copyable
// memory carry every transfer: a report copies the gradient into one (the trainer may free its memory once
// write() returns) while the other's write is in flight.
#pragma once

#include "src/private.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zoe/device.h"
#include "zoe/offload.h"
#include "zoe/space.h"
#include "zoe/status.h"

namespace zoe {

class GradSpill {
 public:
  static constexpr std::size_t kBounceBytes = std::size_t(8) << 20;
  static std::string file_name(const char* store_name) { return std::string(store_name) + ".grads"; }

  // What create() takes: the file on the first NVMe path, and the two bounces.
  static SpaceNeed footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options, const char* store_name);
  // The file is made anew (one a crashed run left is removed first); it is removed when the spill ends.
  static Result<std::unique_ptr<GradSpill>> create(Device& device, const std::vector<ParamSpec>& params,
                                                   const OffloadOptions& options, const char* store_name);
  GradSpill(const GradSpill&) = delete;
  GradSpill& operator=(const GradSpill&) = delete;
  ~GradSpill();

  // Parameter i's whole gradient (its n elements of its dtype at `grads`, device memory) into the file. On
  // return the gradient's memory has been read; the write may still be in flight (flush() waits for it). A
  // failure — here or in a write found at flush() — stays until forget(): the iteration's gradients are
  // incomplete, and the step must not run on them.
  Status write(std::size_t i, const void* grads);
  // Every write done: OK, or the first failure since forget().
  Status flush();
  // Elements [begin, begin + n) of parameter i's gradient into host memory at `out` (after flush()).
  Status read(std::size_t i, std::size_t begin, std::size_t n, void* out);
  // The iteration is given up (or done): its failure is dropped with it.
  void forget();

  std::uint64_t written_bytes() const { return written_; }
  std::uint64_t read_bytes() const { return read_; }
  const std::string& path() const { return path_; }

 private:
  struct Files;
  GradSpill(Device& device, std::vector<std::uint64_t> at, std::vector<std::size_t> elem);
  Status wait_bounce(int k);  // bounce k's write, if one is in flight

  Device& device_;
  std::unique_ptr<Files> files_;  // the folder, the file, the I/O engine
  std::string path_;
  std::vector<std::uint64_t> at_;    // where parameter i's gradient starts in the file (aligned)
  std::vector<std::size_t> n_, elem_;  // its elements, and their bytes
  unsigned char* bounce_[2] = {nullptr, nullptr};
  std::uint64_t ticket_[2] = {0, 0};
  bool in_flight_[2] = {false, false};
  bool writing_[2] = {false, false};  // what is in flight in each: a write, or a read
  int next_ = 0;
  Status failed_;
  std::uint64_t written_ = 0, read_ = 0;
};

}  // namespace zoe
