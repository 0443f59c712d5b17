// The one owner of aligned host memory in the library (kernels, swap I/O and benchmarks allocate here).
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
  AlignedBuffer() = default;
  // bytes rounded up to a multiple of alignment (a power of two); the memory is not initialised.
  static Result<AlignedBuffer> allocate(std::size_t bytes, std::size_t alignment = 64) {
    const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
    if (rounded == 0) return AlignedBuffer();
    void* p = std::aligned_alloc(alignment, rounded);
    if (p == nullptr) {
      return Status(StatusCode::out_of_memory, "cannot allocate " + std::to_string(rounded) + " bytes");
    }
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

  AlignedBuffer(AlignedBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      std::free(data_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t size() const { return size_; }

 private:
  AlignedBuffer(void* p, std::size_t n) : data_(p), size_(n) {}
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace zoe
