// The one owner of aligned host memory in the library (kernels, swap I/O and benchmarks allocate here).
#pragma once

#include <sys/mman.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>
#include <string>
#include <utility>

#include "zoe/status.h"

namespace zoe {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // bytes rounded up to a multiple of alignment (a power of two); the memory is not initialised.
  static Result<AlignedBuffer> allocate(std::size_t bytes, std::size_t alignment = 64) {
    const std::size_t rounded = size_for(bytes, alignment);
    if (rounded == 0) return AlignedBuffer();
    void* p = std::aligned_alloc(alignment, rounded);
    if (p == nullptr) {
      return Status(StatusCode::out_of_memory, "cannot allocate " + std::to_string(rounded) + " bytes");
    }
    count(rounded);
    return AlignedBuffer(p, rounded);
  }
  // Memory that O_DIRECT transfers and device copies go through (I/O bounces, pinned staging): from 2 MiB
  // up, rounded to whole 2 MiB pages and advised onto transparent huge pages. The kernel maps a transfer's
  // buffer page by page; on the development VM's virtio disk, 1 MiB O_DIRECT reads at queue depth 8 ran at
  // 1.1-1.2 GB/s into 4 KiB pages and 2.7 GB/s into huge pages. The advice is only that: with THP off the
  // buffer is as correct.
  static Result<AlignedBuffer> allocate_for_io(std::size_t bytes, std::size_t alignment = 4096) {
    if (bytes < kHugePage || alignment > kHugePage) return allocate(bytes, alignment);
    Result<AlignedBuffer> b = allocate(bytes, kHugePage);
    if (b.ok()) (void)madvise(b->data(), b->size(), MADV_HUGEPAGE);
    return b;
  }
  static constexpr std::size_t kHugePage = std::size_t(2) << 20;
  // The bytes allocate(bytes, alignment) and allocate_for_io(bytes, alignment) take: what zoe counts before
  // allocating (zoe/space.h).
  static constexpr std::size_t size_for(std::size_t bytes, std::size_t alignment = 64) {
    return (bytes + alignment - 1) / alignment * alignment;
  }
  static constexpr std::size_t io_size(std::size_t bytes, std::size_t alignment = 4096) {
    return size_for(bytes, bytes < kHugePage || alignment > kHugePage ? alignment : kHugePage);
  }

  // Bytes of all AlignedBuffers alive in the process, and the most at once since reset_peak(): the tests
  // compare them with the footprints zoe checks against free memory before it allocates (zoe/space.h), so
  // that a footprint cannot drift from the allocations it stands for.
  static std::size_t live_bytes() { return counters().live.load(std::memory_order_relaxed); }
  static std::size_t peak_bytes() { return counters().peak.load(std::memory_order_relaxed); }
  static void reset_peak() { counters().peak.store(live_bytes(), std::memory_order_relaxed); }

  AlignedBuffer(AlignedBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { release(); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t size() const { return size_; }

 private:
  AlignedBuffer(void* p, std::size_t n) : data_(p), size_(n) {}
  struct Counters {
    std::atomic<std::size_t> live{0}, peak{0};
  };
  static Counters& counters() {
    static Counters c;
    return c;
  }
  static void count(std::size_t bytes) {
    Counters& c = counters();
    const std::size_t now = c.live.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    std::size_t peak = c.peak.load(std::memory_order_relaxed);
    while (now > peak && !c.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  void release() {
    if (data_ != nullptr) counters().live.fetch_sub(size_, std::memory_order_relaxed);
    std::free(data_);
  }
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace zoe
