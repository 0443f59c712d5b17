#include "aio/io_engine.h"

#include <libaio.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace zoe::aio {
namespace {

using Clock = std::chrono::steady_clock;

struct Job {
  IoOp op;
  int file;
  std::uint64_t offset;
  char* buffer;
  std::size_t bytes;
  std::size_t issued = 0;       // bytes handed to requests so far
  unsigned outstanding = 0;     // requests not yet completed
  bool done = false;
  Status status;
};

// One request slot: the iocb the kernel sees, and what it belongs to. Slots are preallocated (queue_depth
// of them) and recycled, so steady-state I/O allocates nothing per request.
struct Slot {
  iocb cb{};
  IoEngine::Ticket job = 0;
  IoOp op = IoOp::read;
  std::uint64_t offset = 0;
  std::size_t bytes = 0;
  std::uint64_t index = 0;
};

std::string op_verb(IoOp op) { return op == IoOp::read ? "read" : "write"; }

}  // namespace

struct IoEngine::Impl {
  EngineOptions options;
  io_context_t ctx = nullptr;
  std::vector<std::pair<int, std::string>> files;

  mutable std::mutex mu;
  std::condition_variable work_cv;  // reaper: something entered the kernel, or stop
  std::condition_variable done_cv;  // waiters: a job finished
  std::unordered_map<Ticket, Job> jobs;
  std::deque<Ticket> pending;       // jobs with bytes not yet issued, in submission order
  std::vector<Slot> slots;
  std::vector<Slot*> free_slots;
  std::vector<Slot*> unsubmitted;   // prepared but refused by io_submit (EAGAIN): retried first
  unsigned in_kernel = 0;
  unsigned in_kernel_op[2] = {0, 0};
  Clock::time_point busy_since[2];
  EngineCounters counters;
  std::uint64_t next_index[2] = {0, 0};
  Ticket next_ticket = 1;
  bool stop = false;
  std::thread reaper;

  static int kind(IoOp op) { return op == IoOp::write ? 1 : 0; }

  // Prepares requests for free slots from pending jobs. Called with mu held.
  void prepare(std::vector<Slot*>& batch) {
    batch.swap(unsubmitted);
    while (!free_slots.empty() && !pending.empty()) {
      auto it = jobs.find(pending.front());
      // A failed job may already have been waited for and forgotten while still queued here.
      if (it == jobs.end() || !it->second.status.ok() || it->second.issued == it->second.bytes) {
        pending.pop_front();  // a failed job issues nothing more; finish() marks it done when drained
        continue;
      }
      Job& job = it->second;
      Slot* s = free_slots.back();
      free_slots.pop_back();
      const std::size_t len = std::min(options.request_bytes, job.bytes - job.issued);
      s->job = pending.front();
      s->op = job.op;
      s->offset = job.offset + job.issued;
      s->bytes = len;
      s->index = next_index[kind(job.op)]++;
      const int fd = files[static_cast<std::size_t>(job.file)].first;
      if (job.op == IoOp::read) {
        io_prep_pread(&s->cb, fd, job.buffer + job.issued, len, static_cast<long long>(s->offset));
      } else {
        io_prep_pwrite(&s->cb, fd, job.buffer + job.issued, len, static_cast<long long>(s->offset));
      }
      s->cb.data = s;
      job.issued += len;
      ++job.outstanding;
      batch.push_back(s);
    }
    // Counted in the kernel before io_submit, not after: several threads pump, and the reaper may reap a
    // request before its submitter returns from io_submit. Counted after, the reaper could see a count of
    // requests that are no longer there and wait for them forever.
    const auto now = Clock::now();
    for (Slot* s : batch) entered_kernel(s, now);
  }

  void entered_kernel(Slot* s, Clock::time_point now) {
    const int k = kind(s->op);
    if (in_kernel_op[k]++ == 0) busy_since[k] = now;
    ++in_kernel;
  }

  void left_kernel(Slot* s, Clock::time_point now) {
    const int k = kind(s->op);
    if (--in_kernel_op[k] == 0) {
      (k ? counters.write_busy_s : counters.read_busy_s) += std::chrono::duration<double>(now - busy_since[k]).count();
    }
    --in_kernel;
  }

  // Moves prepared requests into the kernel. io_submit may take fewer than offered (partial submission),
  // be interrupted (EINTR) or be out of resources (EAGAIN): what it did not take is kept for later.
  void pump() {
    std::vector<Slot*> batch;
    {
      std::lock_guard lock(mu);
      prepare(batch);
    }
    std::size_t done = 0;
    while (done < batch.size()) {
      const int r = io_submit(ctx, static_cast<long>(batch.size() - done), reinterpret_cast<iocb**>(batch.data() + done));
      if (r > 0) {
        std::lock_guard lock(mu);
        done += static_cast<std::size_t>(r);
        work_cv.notify_one();
        continue;
      }
      if (r == -EINTR) continue;
      std::lock_guard lock(mu);
      const auto now = Clock::now();
      for (std::size_t i = done; i < batch.size(); ++i) left_kernel(batch[i], now);  // they never entered
      if (r == -EAGAIN || r == 0) {
        unsubmitted.insert(unsubmitted.end(), batch.begin() + static_cast<std::ptrdiff_t>(done), batch.end());
        work_cv.notify_one();
        return;
      }
      // Anything else (EBADF, EINVAL) fails the requests offered; their jobs report it.
      for (std::size_t i = done; i < batch.size(); ++i) finish(batch[i], r);
      return;
    }
  }

  // Records one request's result. Called with mu held, after the request left the kernel (or never
  // entered it). res: bytes transferred, or -errno.
  void finish(Slot* s, long res) {
    Job& job = jobs.at(s->job);
    const std::string& path = files[static_cast<std::size_t>(job.file)].second;
    if (options.fault_hook) {
      IoSite site;
      site.op = s->op;
      site.path = path;
      site.offset = s->offset;
      site.bytes = s->bytes;
      site.index = s->index;
      const IoFault f = options.fault_hook(site);
      if (f.error != 0) {
        res = -f.error;
      } else if (f.transferred >= 0 && res >= 0) {
        res = std::min<long>(res, static_cast<long>(f.transferred));
      }
    }
    if (res >= 0 && static_cast<std::size_t>(res) == s->bytes) {
      (s->op == IoOp::read ? counters.read_bytes : counters.write_bytes) += s->bytes;
    } else if (job.status.ok()) {
      const std::string where = " of " + path + " at offset " + std::to_string(s->offset) + ", length " +
                                std::to_string(s->bytes);
      if (res < 0) {
        const int err = static_cast<int>(-res);
        job.status = Status(StatusCode::io_error, op_verb(s->op) + where + " failed: " + std::strerror(err), err);
      } else {
        job.status = Status(StatusCode::io_error,
                            "short " + op_verb(s->op) + where + ": " + std::to_string(res) + " bytes transferred" +
                                (s->op == IoOp::read ? " (the file ends early: truncated?)" : " (device full?)"));
      }
    }
    --job.outstanding;
    free_slots.push_back(s);
    if (job.outstanding == 0 && (job.issued == job.bytes || !job.status.ok())) {
      job.done = true;
      done_cv.notify_all();
    }
  }

  void reap_loop() {
    std::vector<io_event> events(options.queue_depth);
    for (;;) {
      {
        std::unique_lock lock(mu);
        work_cv.wait(lock, [&] { return stop || in_kernel > 0 || !unsubmitted.empty(); });
        if (in_kernel == 0) {
          if (stop) return;
          // Everything was refused with EAGAIN and nothing is in flight to make room: wait briefly.
          lock.unlock();
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          pump();
          continue;
        }
      }
      // Bounded, so that requests refused with EAGAIN after the count was taken are retried.
      timespec timeout{0, 50 * 1000 * 1000};
      const int r = io_getevents(ctx, 1, static_cast<long>(events.size()), events.data(), &timeout);
      if (r == 0) {
        pump();
        continue;
      }
      if (r == -EINTR) continue;
      if (r < 0) {
        // Only a broken context (EFAULT, EINVAL) gets here; requests in it still point into caller buffers,
        // so the one safe move is to keep asking.
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      {
        std::lock_guard lock(mu);
        const auto now = Clock::now();
        for (int i = 0; i < r; ++i) {
          Slot* s = static_cast<Slot*>(events[static_cast<std::size_t>(i)].data);
          left_kernel(s, now);
          finish(s, static_cast<long>(events[static_cast<std::size_t>(i)].res));
        }
      }
      pump();
    }
  }
};

Result<std::unique_ptr<IoEngine>> IoEngine::create(const EngineOptions& options) {
  if (options.queue_depth == 0) return invalid_argument("queue_depth = 0: at least one request must be in flight");
  if (options.alignment == 0 || (options.alignment & (options.alignment - 1)) != 0) {
    return invalid_argument("alignment = " + std::to_string(options.alignment) + " is not a power of two");
  }
  if (options.request_bytes == 0 || options.request_bytes % options.alignment != 0) {
    return invalid_argument("block_size = " + std::to_string(options.request_bytes) + " is not a positive multiple of the " +
                            std::to_string(options.alignment) + "-byte alignment");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  const int r = io_setup(static_cast<int>(options.queue_depth), &impl->ctx);
  if (r < 0) {
    std::string hint = r == -EAGAIN ? " (the system-wide limit /proc/sys/fs/aio-max-nr is reached: raise it or lower queue_depth)" : "";
    return Status(StatusCode::io_error, "io_setup(" + std::to_string(options.queue_depth) + ") failed: " +
                                            std::strerror(-r) + hint, -r);
  }
  impl->slots.resize(options.queue_depth);
  for (Slot& s : impl->slots) impl->free_slots.push_back(&s);
  Impl* p = impl.get();
  impl->reaper = std::thread([p] { p->reap_loop(); });
  return std::unique_ptr<IoEngine>(new IoEngine(std::move(impl)));
}

IoEngine::IoEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

IoEngine::~IoEngine() {
  // Requests still in the kernel point into caller buffers: they must complete before anyone frees those.
  (void)wait_all();
  {
    std::lock_guard lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->work_cv.notify_all();
  impl_->reaper.join();
  io_destroy(impl_->ctx);
}

int IoEngine::add_file(int fd, std::string path) {
  std::lock_guard lock(impl_->mu);
  impl_->files.emplace_back(fd, std::move(path));
  return static_cast<int>(impl_->files.size() - 1);
}

const std::string& IoEngine::file_path(int file) const { return impl_->files.at(static_cast<std::size_t>(file)).second; }

Result<IoEngine::Ticket> IoEngine::submit(IoOp op, int file, std::uint64_t offset, void* buffer, std::size_t bytes) {
  if (op != IoOp::read && op != IoOp::write) return invalid_argument("submit: op must be read or write");
  if (file < 0 || static_cast<std::size_t>(file) >= impl_->files.size()) {
    return invalid_argument("submit: file index " + std::to_string(file) + " is not registered");
  }
  const std::size_t a = impl_->options.alignment;
  const std::string what = op_verb(op) + " of " + file_path(file) + ": ";
  const std::string rule = " is not a multiple of the " + std::to_string(a) + "-byte block (O_DIRECT needs it)";
  if (reinterpret_cast<std::uintptr_t>(buffer) % a != 0) {
    char addr[32];
    std::snprintf(addr, sizeof addr, "%p", buffer);
    return invalid_argument(what + "buffer address " + addr + rule);
  }
  if (offset % a != 0) return invalid_argument(what + "file offset " + std::to_string(offset) + rule);
  if (bytes % a != 0) return invalid_argument(what + "length " + std::to_string(bytes) + rule);
  if (bytes > 0 && buffer == nullptr) return invalid_argument(what + "buffer is null");
  Ticket t;
  {
    std::lock_guard lock(impl_->mu);
    t = impl_->next_ticket++;
    Job job{op, file, offset, static_cast<char*>(buffer), bytes, 0, 0, false, Status::success()};
    job.done = bytes == 0;
    impl_->jobs.emplace(t, std::move(job));
    if (bytes > 0) impl_->pending.push_back(t);
  }
  impl_->pump();
  return t;
}

Status IoEngine::wait(Ticket ticket) {
  std::unique_lock lock(impl_->mu);
  auto it = impl_->jobs.find(ticket);
  if (it == impl_->jobs.end()) return Status(StatusCode::internal, "wait: unknown ticket " + std::to_string(ticket));
  // A submit() meanwhile may rehash the map: iterators die, references to elements stay valid.
  Job* job = &it->second;
  impl_->done_cv.wait(lock, [job] { return job->done; });
  Status s = std::move(job->status);
  impl_->jobs.erase(ticket);
  return s;
}

Status IoEngine::wait_all() {
  std::unique_lock lock(impl_->mu);
  impl_->done_cv.wait(lock, [&] {
    for (const auto& [t, job] : impl_->jobs) {
      if (!job.done) return false;
    }
    return true;
  });
  Status first;
  Ticket first_ticket = 0;
  for (auto& [t, job] : impl_->jobs) {
    if (!job.status.ok() && (first.ok() || t < first_ticket)) {
      first = job.status;
      first_ticket = t;
    }
  }
  impl_->jobs.clear();
  return first;
}

EngineCounters IoEngine::counters() const {
  std::lock_guard lock(impl_->mu);
  EngineCounters c = impl_->counters;
  const auto now = Clock::now();
  // Count busy time up to now for a kind still in flight.
  if (impl_->in_kernel_op[0] > 0) c.read_busy_s += std::chrono::duration<double>(now - impl_->busy_since[0]).count();
  if (impl_->in_kernel_op[1] > 0) c.write_busy_s += std::chrono::duration<double>(now - impl_->busy_since[1]).count();
  return c;
}

void IoEngine::reset_counters() {
  std::lock_guard lock(impl_->mu);
  impl_->counters = {};
  const auto now = Clock::now();
  impl_->busy_since[0] = impl_->busy_since[1] = now;
}

const EngineOptions& IoEngine::options() const { return impl_->options; }

}  // namespace zoe::aio
