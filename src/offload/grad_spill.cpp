// Tier nvme's gradient spill: see grad_spill.h.
#include "src/offload/grad_spill.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "base/files.h"
#include "zoe/aligned_buffer.h"
#include "zoe/dtype.h"
#ifdef ZOE_HAVE_AIO
#include "aio/files.h"
#include "aio/io_engine.h"
#endif

namespace zoe {

namespace {

std::size_t alignment_of(const OffloadOptions& options) { return std::max<std::size_t>(options.nvme.alignment, 4096); }

// Where each parameter's gradient starts in the file, and the file's size: each from an aligned boundary.
std::vector<std::uint64_t> layout(const std::vector<ParamSpec>& params, std::size_t align) {
  std::vector<std::uint64_t> at(params.size() + 1, 0);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::uint64_t bytes = std::uint64_t(params[i].n) * dtype_size(params[i].dtype);
    at[i + 1] = at[i] + (bytes + align - 1) / align * align;
  }
  return at;
}

}  // namespace

SpaceNeed GradSpill::footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options,
                               const char* store_name) {
  SpaceNeed need;
  if (options.nvme.paths.empty()) return need;
  need.add_disk(options.nvme.paths.front(), layout(params, alignment_of(options)).back(), {file_name(store_name)});
  need.add_ram("the gradient spill's bounce buffers", 2 * AlignedBuffer::io_size(kBounceBytes));
  return need;
}

#ifdef ZOE_HAVE_AIO
struct GradSpill::Files {
  Folder folder;
  std::string name;
  aio::FileHandle fd;
  std::unique_ptr<aio::IoEngine> engine;
  int file = -1;
  std::size_t align = 4096;
  ~Files() {
    engine.reset();  // waits for what is in flight before the file goes
    fd = aio::FileHandle();
    (void)folder.remove(name);
  }
};

GradSpill::GradSpill(Device& device, std::vector<std::uint64_t> at, std::vector<std::size_t> elem)
    : device_(device), at_(std::move(at)), elem_(std::move(elem)) {}

GradSpill::~GradSpill() {
  files_.reset();  // the engine first: no write may still use a bounce
  for (unsigned char* b : bounce_) device_.free_host(b);
}

Result<std::unique_ptr<GradSpill>> GradSpill::create(Device& device, const std::vector<ParamSpec>& params,
                                                     const OffloadOptions& options, const char* store_name) {
  if (options.nvme.paths.empty()) return invalid_argument("spill_grads needs an nvme_path (tier nvme)");
  std::vector<std::size_t> elem(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) elem[i] = dtype_size(params[i].dtype);
  auto files = std::make_unique<Files>();
  Result<Folder> folder = aio::open_swap_dir(options.nvme.paths.front(), "swap path");
  if (!folder.ok()) return folder.status();
  files->folder = std::move(folder).value();
  files->name = file_name(store_name);
  const std::string path = files->folder.path_of(files->name);
  // A crashed run's spill: nothing in it outlives an iteration (a link there goes, not its target).
  (void)files->folder.remove(files->name);
  Result<aio::OpenedFile> opened = aio::open_swap_file(files->folder, files->name, true, options.nvme.fault_hook);
  if (!opened.ok()) return opened.status();
  files->fd = std::move(opened->fd);
  // As the swap store settles its own: what the option asks, and what the filesystem asks of this file.
  const auto [offset_align, mem_align] = aio::dio_alignment(files->fd.get());
  files->align = std::max<std::size_t>({alignment_of(options), offset_align, mem_align});
  if ((files->align & (files->align - 1)) != 0 || kBounceBytes % files->align != 0) {
    return invalid_argument("gradient spill file " + path + ": O_DIRECT alignment " + std::to_string(files->align) +
                            " bytes is not a power of two dividing the spill's " + std::to_string(kBounceBytes) +
                            "-byte bounce buffers");
  }
  std::unique_ptr<GradSpill> spill(new GradSpill(device, layout(params, files->align), std::move(elem)));
  spill->n_.reserve(params.size());
  for (const ParamSpec& p : params) spill->n_.push_back(p.n);
  spill->path_ = path;
  const std::uint64_t size = spill->at_.back();
  if (Status s = aio::allocate_file(files->fd.get(), spill->path_, std::max<std::uint64_t>(size, files->align),
                                    options.nvme.fault_hook);
      !s.ok()) {
    return s;
  }
  aio::EngineOptions eo;
  eo.queue_depth = static_cast<unsigned>(std::max(1, options.nvme.queue_depth));
  eo.request_bytes = std::max(files->align, options.nvme.block_size / files->align * files->align);
  eo.alignment = files->align;
  eo.fault_hook = options.nvme.fault_hook;
  Result<std::unique_ptr<aio::IoEngine>> engine = aio::IoEngine::create(eo);
  if (!engine.ok()) return engine.status();
  files->engine = std::move(engine).value();
  files->file = files->engine->add_file(files->fd.get(), spill->path_);
  spill->files_ = std::move(files);
  for (unsigned char*& b : spill->bounce_) {
    Result<void*> r = device.allocate_host(kBounceBytes);
    if (!r.ok()) return r.status();
    b = static_cast<unsigned char*>(r.value());
  }
  return spill;
}

Status GradSpill::wait_bounce(int k) {
  if (!in_flight_[k]) return Status::success();
  in_flight_[k] = false;
  Status s = files_->engine->wait(ticket_[k]);
  // A failed write loses a gradient the trainer may have freed; a failed read loses nothing (read again).
  if (!s.ok() && writing_[k] && failed_.ok()) failed_ = s;
  return s;
}

Status GradSpill::write(std::size_t i, const void* grads) {
  if (!failed_.ok()) return failed_;  // this iteration's gradients are incomplete already
  const std::size_t bytes = n_[i] * elem_[i], align = files_->align;
  const auto* from = static_cast<const unsigned char*>(grads);
  for (std::size_t done = 0; done < bytes;) {
    const int k = next_;
    if (Status s = wait_bounce(k); !s.ok()) return s;
    const std::size_t n = std::min(kBounceBytes, bytes - done);
    if (Status s = device_.copy_to_host(bounce_[k], from + done, n, Stream::d2h); !s.ok()) return failed_ = s;
    Result<EventId> copied = device_.record(Stream::d2h);
    if (!copied.ok()) return failed_ = copied.status();
    if (Status s = device_.synchronize(copied.value()); !s.ok()) return failed_ = s;
    const std::size_t padded = (n + align - 1) / align * align;
    std::memset(bounce_[k] + n, 0, padded - n);  // the parameter's own padding: never read as a gradient
    Result<std::uint64_t> t = files_->engine->submit(IoOp::write, files_->file, at_[i] + done, bounce_[k], padded);
    if (!t.ok()) return failed_ = t.status();
    ticket_[k] = t.value();
    in_flight_[k] = writing_[k] = true;
    next_ ^= 1;
    done += n;
    written_ += padded;
  }
  return Status::success();
}

Status GradSpill::flush() {
  for (int k = 0; k < 2; ++k) (void)wait_bounce(k);
  return failed_;
}

Status GradSpill::read(std::size_t i, std::size_t begin, std::size_t n, void* out) {
  if (Status s = flush(); !s.ok()) return s;
  const std::size_t align = files_->align;
  // The aligned range around the elements asked for, through the bounces two at a time: one read in flight
  // while the one before it is copied out.
  const std::uint64_t first = at_[i] + std::uint64_t(begin) * elem_[i], last = first + std::uint64_t(n) * elem_[i];
  const std::uint64_t lo = first / align * align, hi = (last + align - 1) / align * align;
  auto* dst = static_cast<unsigned char*>(out);
  auto copy_out = [&](int k, std::uint64_t at, std::size_t len) {
    const std::uint64_t a = std::max(at, first), b = std::min<std::uint64_t>(at + len, last);
    if (a < b) std::memcpy(dst + (a - first), bounce_[k] + (a - at), b - a);
  };
  std::uint64_t prev_at = 0;
  std::size_t prev_len = 0;
  int k = 0;
  for (std::uint64_t at = lo; at < hi; at += kBounceBytes, k ^= 1) {
    const std::size_t len = static_cast<std::size_t>(std::min<std::uint64_t>(kBounceBytes, hi - at));
    Result<std::uint64_t> t = files_->engine->submit(IoOp::read, files_->file, at, bounce_[k], len);
    if (!t.ok()) {
      (void)wait_bounce(k ^ 1);
      return t.status();
    }
    ticket_[k] = t.value();
    in_flight_[k] = true;
    writing_[k] = false;
    read_ += len;
    if (at > lo) {
      if (Status s = wait_bounce(k ^ 1); !s.ok()) return s;
      copy_out(k ^ 1, prev_at, prev_len);
    }
    prev_at = at;
    prev_len = len;
  }
  if (hi > lo) {
    if (Status s = wait_bounce(k ^ 1); !s.ok()) return s;
    copy_out(k ^ 1, prev_at, prev_len);
  }
  return Status::success();
}

void GradSpill::forget() { failed_ = Status(); }
#else
struct GradSpill::Files {};
GradSpill::GradSpill(Device& device, std::vector<std::uint64_t> at, std::vector<std::size_t> elem)
    : device_(device), at_(std::move(at)), elem_(std::move(elem)) {}
GradSpill::~GradSpill() = default;
Result<std::unique_ptr<GradSpill>> GradSpill::create(Device&, const std::vector<ParamSpec>&, const OffloadOptions&,
                                                     const char*) {
  return Status(StatusCode::unsupported, "spill_grads: this build of zoe has no libaio NVMe tier (-Daio=disabled)");
}
Status GradSpill::write(std::size_t, const void*) { return Status(StatusCode::unsupported, "spill_grads: no libaio"); }
Status GradSpill::flush() { return Status::success(); }
Status GradSpill::read(std::size_t, std::size_t, std::size_t, void*) {
  return Status(StatusCode::unsupported, "spill_grads: no libaio");
}
void GradSpill::forget() {}
#endif

}  // namespace zoe
