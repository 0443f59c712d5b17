// zoe/param_tier.h's RawReadCeiling: raw O_DIRECT reads of the NVMe home's files, the ceiling its fetches
// are measured against. Written once, every entry's valid copy is in the first half of its file, back to
// back: these are the very bytes the fetches read.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "aio/files.h"
#include "aio/io_engine.h"
#include "zoe/aligned_buffer.h"
#include "zoe/param_tier.h"

namespace zoe {

struct RawReadCeiling::Impl {
  aio::EngineOptions engine_options;
  std::size_t request_bytes = 0;
  std::vector<std::pair<std::string, aio::FileHandle>> files;
  std::uint64_t per_file = 0;
  AlignedBuffer buffer;  // every file reads into it; the bytes are not looked at
};

RawReadCeiling::RawReadCeiling(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RawReadCeiling::RawReadCeiling(RawReadCeiling&&) noexcept = default;
RawReadCeiling& RawReadCeiling::operator=(RawReadCeiling&&) noexcept = default;
RawReadCeiling::~RawReadCeiling() = default;

Result<RawReadCeiling> RawReadCeiling::open(const std::vector<std::string>& files, std::uint64_t bytes,
                                            const ParamTierOptions& o) {
  if (files.empty() || o.request_bytes == 0) return invalid_argument("raw read ceiling: no files, or requests of 0 bytes");
  auto r = std::make_unique<Impl>();
  r->request_bytes = o.request_bytes;
  r->engine_options.queue_depth = static_cast<unsigned>(o.queue_depth);
  r->engine_options.request_bytes = o.request_bytes;
  for (const std::string& f : files) {
    aio::FileHandle fd(::open(f.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
    if (fd.get() < 0) return Status(StatusCode::io_error, "cannot open " + f + " with O_DIRECT", errno);
    r->files.push_back({f, std::move(fd)});
  }
  r->per_file = (bytes / files.size() + o.request_bytes - 1) / o.request_bytes * o.request_bytes;
  // Memory of the kind the tier's bounces are (huge pages where the kernel gives them), touched now.
  Result<AlignedBuffer> buffer = AlignedBuffer::allocate_for_io(r->per_file, 4096);
  if (!buffer.ok()) return buffer.status();
  std::memset(buffer->data(), 0, buffer->size());
  r->buffer = std::move(buffer).value();
  return RawReadCeiling(std::move(r));
}

Result<double> RawReadCeiling::pass() {
  Impl& r = *impl_;
  Result<std::unique_ptr<aio::IoEngine>> engine = aio::IoEngine::create(r.engine_options);
  if (!engine.ok()) return engine.status();
  std::vector<int> ids;
  for (const auto& [path, fd] : r.files) ids.push_back(engine.value()->add_file(fd.get(), path));
  Status s;
  const auto start = std::chrono::steady_clock::now();
  std::vector<aio::IoEngine::Ticket> tickets;
  for (std::size_t k = 0; k < ids.size() && s.ok(); ++k) {
    for (std::uint64_t at = 0; at < r.per_file && s.ok(); at += r.request_bytes) {
      Result<aio::IoEngine::Ticket> t =
          engine.value()->submit(IoOp::read, ids[k], at, r.buffer.as<unsigned char>() + at, r.request_bytes);
      if (!t.ok()) s = t.status();
      else tickets.push_back(t.value());
    }
  }
  for (aio::IoEngine::Ticket t : tickets) {
    if (Status w = engine.value()->wait(t); !w.ok() && s.ok()) s = w;
  }
  if (!s.ok()) return s;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace zoe
