// zoe probe PATH...: whether each folder can hold swap files, and how fast: filesystem type, O_DIRECT,
// logical block size, free bytes, a short measured write and read bandwidth, the swap stores already there
// (in use, or left by runs that crashed or ended, with the command that removes them), and a verdict.
// Leftover stores are a warning, not a reason to call the path unusable: the space is freed with one rm.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "aio/files.h"
#include "aio/io_engine.h"
#include "src/nvme/swap_inventory.h"
#include "zoe/aligned_buffer.h"
#include "tools/args.h"
#include "tools/commands.h"
#include "tools/probe.h"
#include "tools/report.h"

namespace zoe::cli {
namespace {

struct Probe {
  std::string path, fs_type = "unknown", verdict;
  bool usable = false, direct = false;
  std::uint32_t logical_block = 0, dio_align = 0;
  std::uint64_t free_bytes = 0;
  double write_gbps = 0, read_gbps = 0;
  std::vector<aio::FoundStore> stores;
};

// Writes then reads `bytes` through the libaio engine (1 MiB requests, queue depth 8), fdatasync included
// in the write time so that a write cache does not flatter it.
Status measure(const std::string& file, int fd, std::size_t bytes, double& write_gbps, double& read_gbps) {
  aio::EngineOptions eo;
  eo.queue_depth = 8;
  eo.request_bytes = 1 << 20;
  eo.alignment = 4096;
  Result<std::unique_ptr<aio::IoEngine>> engine = aio::IoEngine::create(eo);
  if (!engine.ok()) return engine.status();
  const int f = (*engine)->add_file(fd, file);
  constexpr std::size_t kChunk = 16 << 20;
  Result<AlignedBuffer> buf = AlignedBuffer::allocate_for_io(2 * kChunk, 4096);  // as the swap store's buffers
  if (!buf.ok()) return buf.status();
  for (std::size_t i = 0; i < 2 * kChunk / 4; ++i) buf->as<std::uint32_t>()[i] = static_cast<std::uint32_t>(i * 2654435761u);
  for (int pass = 0; pass < 2; ++pass) {
    const IoOp op = pass == 0 ? IoOp::write : IoOp::read;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<aio::IoEngine::Ticket> tickets;
    for (std::size_t off = 0; off < bytes; off += kChunk) {
      Result<aio::IoEngine::Ticket> t = (*engine)->submit(op, f, off, buf->as<char>() + (tickets.size() % 2) * kChunk,
                                                          std::min(kChunk, bytes - off));
      if (!t.ok()) return t.status();
      tickets.push_back(t.value());
    }
    if (Status s = (*engine)->wait_all(); !s.ok()) return s;
    if (pass == 0) {
      if (Status s = aio::sync_file(fd, file, {}); !s.ok()) return s;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    (pass == 0 ? write_gbps : read_gbps) = static_cast<double>(bytes) / secs / 1e9;
  }
  return Status::success();
}

Probe probe_one(const std::string& path, std::size_t bytes) {
  Probe p;
  p.path = path;
  Result<aio::FsInfo> info = aio::fs_info(path);
  if (info.ok()) {
    p.fs_type = info->type;
    p.free_bytes = info->free_bytes;
  }
  Result<Folder> folder = aio::open_swap_dir(path, "swap path");
  if (!folder.ok()) {
    p.verdict = "unusable: " + folder.status().message();
    return p;
  }
  p.stores = aio::find_swap_stores(path);
  // A name nobody can guess, created exclusively and never reopened: the measurement's writes go nowhere else.
  const std::string name = ".zoe-probe-" + random_hex();
  const std::string file = folder->path_of(name);
  Result<aio::OpenedFile> opened = aio::open_swap_file(*folder, name, true, {});
  if (!opened.ok()) {
    p.verdict = "unusable: " + opened.status().message();
    return p;
  }
  p.direct = opened->direct;
  p.dio_align = aio::dio_alignment(opened->fd.get()).first;
  p.logical_block = aio::device_logical_block(path);
  if (p.logical_block == 0) p.logical_block = p.dio_align;
  Status s = aio::allocate_file(opened->fd.get(), file, bytes, {});
  if (s.ok()) s = measure(file, opened->fd.get(), bytes, p.write_gbps, p.read_gbps);
  opened->fd.reset();
  (void)folder->remove(name);
  if (!s.ok()) {
    p.verdict = "unusable: " + s.message();
    return p;
  }
  p.usable = true;
  if (!p.direct) {
    p.verdict = "usable with a warning: no O_DIRECT on " + p.fs_type +
                ", so swap I/O is buffered through the page cache (slower, uses RAM)";
  } else if (p.fs_type == "tmpfs" || p.fs_type == "ramfs") {
    p.verdict = "usable with a warning: " + p.fs_type + " lives in RAM, so swapping there saves no memory";
  } else if (p.fs_type == "nfs" || p.fs_type == "cifs" || p.fs_type == "fuse" || p.fs_type == "9p") {
    p.verdict = "usable with a warning: " + p.fs_type + " is a network or user-space filesystem; prefer local NVMe";
  } else {
    p.verdict = "ok";
  }
  return p;
}

// Stores nobody is known to use are worth a warning: each holds its state twice over, often many GiB.
void warn_about_stores(Probe& p) {
  std::uint64_t abandoned = 0, unknown = 0;
  int n_abandoned = 0, n_unknown = 0;
  for (const aio::FoundStore& s : p.stores) {
    if (s.state == aio::StoreState::abandoned) abandoned += s.bytes, ++n_abandoned;
    if (s.state == aio::StoreState::unknown) unknown += s.bytes, ++n_unknown;
  }
  std::string warning;
  if (n_abandoned > 0) {
    warning = std::to_string(n_abandoned) + " swap store(s) of runs that are not running hold " +
              aio::format_bytes(abandoned) + " here; each is listed with the rm command that removes it";
  }
  if (n_unknown > 0) {
    warning += (warning.empty() ? "" : "; ") + std::to_string(n_unknown) + " swap store(s) of " +
               aio::format_bytes(unknown) + " whose runs cannot be checked from here: remove them once no run uses them";
  }
  if (warning.empty()) return;
  if (p.verdict == "ok") p.verdict = "usable with a warning: " + warning;
  else p.verdict += "; " + warning;
}

std::string stores_json(const std::vector<aio::FoundStore>& stores) {
  std::string out = "[";
  for (const aio::FoundStore& s : stores) {
    const char* state = s.state == aio::StoreState::in_use ? "in_use" : s.state == aio::StoreState::abandoned ? "abandoned" : "unknown";
    std::string files;
    for (const std::string& f : s.files) files += (files.empty() ? "\"" : ", \"") + json_escape(f) + "\"";
    JsonLine line;
    line.add("name", s.name).add("bytes", s.bytes).add("state", state).add("who", s.who).add_json("files", "[" + files + "]");
    if (s.state != aio::StoreState::in_use) line.add("remove_command", aio::remove_command(s));
    out += (out.size() > 1 ? ", " : "") + line.str();
  }
  return out + "]";
}

std::string stores_text(const std::vector<aio::FoundStore>& stores) {
  std::string out;
  if (stores.empty()) out += "  swap stores     none\n";
  for (const aio::FoundStore& s : stores) {
    out += format("  swap store      %s: %s in %zu files, %s\n", s.name.c_str(), aio::format_bytes(s.bytes).c_str(),
                  s.files.size(), s.who.c_str());
    if (s.state != aio::StoreState::in_use) out += format("                  remove: %s\n", aio::remove_command(s).c_str());
  }
  return out;
}

std::string probe_text(const Probe& p, std::size_t measured_bytes) {
  std::string out = p.path + "\n" + format("  filesystem      %s\n", p.fs_type.c_str());
  if (p.usable) {
    out += format("  O_DIRECT        %s\n", p.direct ? "yes" : "no (buffered fallback)");
    if (p.logical_block == 0) {
      out += "  logical block   unknown (no block device under it; zoe assumes 4096)\n";
    } else {
      out += format("  logical block   %u bytes%s\n", p.logical_block,
                    p.dio_align ? (" (O_DIRECT alignment " + std::to_string(p.dio_align) + ")").c_str() : "");
    }
    out += format("  free            %.1f GiB\n", static_cast<double>(p.free_bytes) / (1ull << 30));
    out += format("  bandwidth       write %.2f GB/s, read %.2f GB/s (%.0f MiB, 1 MiB requests, queue depth 8)\n",
                  p.write_gbps, p.read_gbps, static_cast<double>(measured_bytes) / (1 << 20));
  }
  if (p.usable || !p.stores.empty()) out += stores_text(p.stores);  // a path that failed early was not looked into
  return out + format("  verdict         %s\n", p.verdict.c_str());
}

void report_probe(Report& report, const Probe& p, std::size_t measured_bytes) {
  JsonLine line;
  line.add("path", p.path).add("fs", p.fs_type).add("direct_io", p.direct)
      .add("logical_block", static_cast<std::uint64_t>(p.logical_block))
      .add("dio_alignment", static_cast<std::uint64_t>(p.dio_align)).add("free_bytes", p.free_bytes)
      .add("write_gbps", p.write_gbps).add("read_gbps", p.read_gbps).add("usable", p.usable)
      .add_json("swap_stores", stores_json(p.stores)).add("verdict", p.verdict);
  report.result(line, probe_text(p, measured_bytes));
}

}  // namespace

Status measure_path(const std::string& path, std::size_t bytes, double* write_gbps, double* read_gbps) {
  const Probe p = probe_one(path, bytes);
  if (!p.usable) return invalid_argument(path + ": " + p.verdict);
  *write_gbps = p.write_gbps;
  *read_gbps = p.read_gbps;
  return Status::success();
}

int probe(std::span<char* const> args) {
  std::string bytes_text = "256M";
  bool json = false, help = false;
  std::vector<std::string> paths;
  std::vector<char*> option_args;
  for (char* a : args) {
    if (std::string_view(a).rfind("--", 0) == 0 || (!option_args.empty() && std::string_view(option_args.back()) == "--bytes" &&
                                                    std::string_view(a).rfind("--", 0) != 0)) {
      option_args.push_back(a);
    } else {
      paths.emplace_back(a);
    }
  }
  const Option options[] = {
      {"bytes", &bytes_text, nullptr, "bytes written and read back per path for the bandwidth figures, 1 to 16G"},
      {"json", nullptr, &json, "one JSON object per path on stdout, nothing else"},
      {"help", nullptr, &help, "this help"},
  };
  constexpr std::string_view kCommand = "zoe probe";
  if (Status s = parse_options(option_args, options); !s.ok()) return fail_message(kCommand, s);
  if (help || paths.empty()) {
    print_help("usage: zoe probe PATH... [options]\n\n", options,
               "\nExit status 1 if any path is unusable for swap files. Swap stores left there by runs that are not\n"
               "running are listed with the command that removes them; they make a warning, not an unusable path.\n");
    return help ? 0 : 2;
  }
  // At most 16G (docs/cli.md): a bandwidth figure needs no more, and the rounding up to whole MiB below
  // cannot wrap (2^64 - 1 became 0 bytes, "measured" as ok).
  Result<std::uint64_t> bytes = parse_count_in(bytes_text, "--bytes", 1, 16ull << 30, "bytes written and read back per path");
  if (!bytes.ok()) return fail_message(kCommand, bytes.status());
  const std::size_t rounded = (bytes.value() + (1 << 20) - 1) / (1 << 20) * (1 << 20);
  Report report(kCommand, json);
  int status = 0;
  for (const std::string& path : paths) {
    Probe p = probe_one(path, rounded);
    if (!p.usable) status = 1;
    warn_about_stores(p);
    report_probe(report, p, rounded);
  }
  return status;
}

}  // namespace zoe::cli
