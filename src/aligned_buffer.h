// The one owner of aligned host memory in the library (kernels, swap I/O and benchmarks allocate here).
#pragma once

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
