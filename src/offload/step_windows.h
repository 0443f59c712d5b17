// Tier nvme's streamed step (Impl::streamed: the sync schedule, no micro-batch sums). Host memory that does
// not grow with the model: instead of a 16-bit gradient staging and a 16-bit weight staging the size of the
// model (4 bytes per parameter), the step runs over the store window by window — whole tiles, so that no tile
// is stepped by two calls — and holds only one window's weights, and (on a device with memory of its own)
// one window's gradients:
//  - gradients: read where the device keeps them when its memory is host memory (the CPU as the device:
//    FSDP2's own gradients, never copied); else copied down into the gradient window before its tiles step;
//  - weights: the store's step writes each element's 16-bit weight into the weight window; a parameter
//    whose last element has been stepped is sent whole (its parameter-tier entry is written whole: the NVMe
//    home rewrites an entry as one piece), and the one that continues into the next window keeps its part
//    at the window's start. A window therefore holds at least the largest parameter and two tiles.
// Where the weights are needed outside a step (a load, write_state, a checkpoint's "weights16", a send that
// failed) they are rounded again from the masters in the store: they are the bits the step sent.
#pragma once

#include "src/private.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "src/offload/optimizer_impl.h"
#include "zoe/swap.h"

namespace zoe {

class StepWindows {
 public:
  // The window's size in elements when the largest parameter is smaller: 64 MiB of 16-bit weights, enough
  // for each store.step() call to keep its read-ahead busy over tens of tiles. zoe plan counts it.
  static constexpr std::size_t kWindowElements = std::size_t(1) << 25;

  // `at`: where each parameter starts in `store` (at.back(): the store's size); `tile`: its tile.
  static Result<std::unique_ptr<StepWindows>> make(Impl& m, SwapStore& store, const std::vector<std::size_t>& at,
                                                   std::size_t tile);
  StepWindows(const StepWindows&) = delete;
  StepWindows& operator=(const StepWindows&) = delete;
  ~StepWindows();

  // One step of every parameter with a gradient in staging set `set`, window by window; each 16-bit
  // parameter's weights are sent as its window ends. A store failure stops it (the store's retry completes
  // the step); a failed send marks the parameter in m.unsent and the step goes on.
  Status step(float grad_scale, int set, const std::vector<ParamGroup>& hyper, SwapStats* io);
  // Parameter i's 16-bit weights [begin, begin + n) widened into `out`, read from the device or its
  // parameter tier a window of parameters at a time (the store's initialisation, in element order).
  Status widen(std::size_t i, std::size_t begin, std::size_t n, float* out);
  // The 16-bit parameters marked in `which` (all: null) rounded from the store's masters and sent.
  Status resend(const std::vector<char>* which);
  // Bytes [offset, offset + n) of the "weights16" blob (16-bit parameters in order), from the masters.
  Status read_weights16(std::size_t offset, std::size_t n, void* out);

 private:
  StepWindows(Impl& m, SwapStore& store, const std::vector<std::size_t>& at, std::size_t tile)
      : m_(m), store_(store), at_(at), tile_(tile) {}
  std::size_t param_at(std::size_t store_at) const;  // the parameter holding store element `store_at`
  // Rounds parameter i's masters [first, first + count) from the store into `out` (16-bit values).
  Status round_masters(std::size_t i, std::size_t first, std::size_t count, void* out);
  Status grads_down(const std::vector<Piece>& parts, std::size_t lo);
  Status send(const std::vector<std::size_t>& done, std::size_t base);

  Impl& m_;
  SwapStore& store_;
  const std::vector<std::size_t>& at_;
  std::size_t tile_;
  std::size_t capacity_ = 0;     // elements of each window
  std::size_t grad_stride_ = 2;  // bytes per element of the gradient window (4 with an f32 parameter)
  unsigned char* weights_ = nullptr;
  unsigned char* grads_ = nullptr;  // null where the gradients are read in place
  // widen(): parameters [loaded_first_, loaded_end_) are in weights_, from store element loaded_base_.
  std::size_t loaded_first_ = 0, loaded_end_ = 0, loaded_base_ = 0;
  Status send_error_;  // the first failed tier write since the step began: resend() reports it
};

}  // namespace zoe
