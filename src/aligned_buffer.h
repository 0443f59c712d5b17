// The one owner of aligned host memory in the library (kernels, swap I/O and benchmarks allocate here).
// From 2 MiB up, memory comes straight from mmap with transparent huge pages requested (madvise): the
// optimizer state is streamed end to end, and 2 MiB pages spare the TLB misses of 4 KiB ones.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <new>
#include <string>
#include <utility>

#include "zoe/status.h"

namespace zoe {

class AlignedBuffer {
 public:
  static constexpr std::size_t kHugePage = std::size_t(2) << 20;

  AlignedBuffer() = default;
  // bytes rounded up to a multiple of alignment (a power of two, at most 4096 when bytes >= 2 MiB); the
  // memory is not initialised.
  static Result<AlignedBuffer> allocate(std::size_t bytes, std::size_t alignment = 64) {
    const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
    if (rounded == 0) return AlignedBuffer();
    if (rounded >= kHugePage && alignment <= 4096) {
      void* p = ::mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) {
        return Status(StatusCode::out_of_memory, "cannot map " + std::to_string(rounded) + " bytes", errno);
      }
      (void)::madvise(p, rounded, MADV_HUGEPAGE);  // a request: without THP the pages stay 4 KiB
      return AlignedBuffer(p, rounded, true);
    }
    void* p = std::aligned_alloc(alignment, rounded);
    if (p == nullptr) {
      return Status(StatusCode::out_of_memory, "cannot allocate " + std::to_string(rounded) + " bytes");
    }
    return AlignedBuffer(p, rounded, false);
  }
  AlignedBuffer(AlignedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), mapped_(o.mapped_) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      mapped_ = o.mapped_;
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
  AlignedBuffer(void* p, std::size_t n, bool mapped) : data_(p), size_(n), mapped_(mapped) {}
  void release() {
    if (data_ == nullptr) return;
    if (mapped_) {
      ::munmap(data_, size_);
    } else {
      std::free(data_);
    }
    data_ = nullptr;
  }
  void* data_ = nullptr;
  std::size_t size_ = 0;
  bool mapped_ = false;
};

}  // namespace zoe
