// zoe probe PATH...: the library's probe of each folder for swap files (zoe/swap_probe.h: filesystem,
// O_DIRECT, block size, space, bandwidth, the stores already there, a verdict), as lines or JSON.
#include <cstdio>
#include <string>
#include <vector>

#include "tools/args.h"
#include "tools/commands.h"
#include "tools/probe.h"
#include "tools/report.h"
#include "zoe/swap_probe.h"

namespace zoe::cli {
namespace {

std::string stores_json(const std::vector<SwapStoreFound>& stores) {
  std::string out = "[";
  for (const SwapStoreFound& s : stores) {
    const char* state = s.state == SwapStoreState::in_use ? "in_use" : s.state == SwapStoreState::abandoned ? "abandoned" : "unknown";
    std::string files;
    for (const std::string& f : s.files) files += (files.empty() ? "\"" : ", \"") + json_escape(f) + "\"";
    JsonLine line;
    line.add("name", s.name).add("bytes", s.bytes).add("state", state).add("who", s.who).add_json("files", "[" + files + "]");
    if (s.state != SwapStoreState::in_use) line.add("remove_command", s.remove_command);
    out += (out.size() > 1 ? ", " : "") + line.str();
  }
  return out + "]";
}

std::string stores_text(const std::vector<SwapStoreFound>& stores) {
  std::string out;
  if (stores.empty()) out += "  swap stores     none\n";
  for (const SwapStoreFound& s : stores) {
    out += format("  swap store      %s: %s in %zu files, %s\n", s.name.c_str(), format_bytes(s.bytes).c_str(),
                  s.files.size(), s.who.c_str());
    if (s.state != SwapStoreState::in_use) out += format("                  remove: %s\n", s.remove_command.c_str());
  }
  return out;
}

std::string probe_text(const SwapPathProbe& p, std::size_t measured_bytes) {
  std::string out = p.path + "\n" + format("  filesystem      %s\n", p.fs_type.c_str());
  if (p.usable) {
    out += format("  O_DIRECT        %s\n", p.direct ? "yes" : "no (buffered fallback)");
    if (p.logical_block == 0) {
      out += "  logical block   unknown (no block device under it; zoe assumes 4096)\n";
    } else {
      out += format("  logical block   %u bytes%s\n", p.logical_block,
                    p.dio_alignment ? (" (O_DIRECT alignment " + std::to_string(p.dio_alignment) + ")").c_str() : "");
    }
    out += format("  free            %.1f GiB\n", static_cast<double>(p.free_bytes) / (1ull << 30));
    out += format("  bandwidth       write %.2f GB/s, read %.2f GB/s (%.0f MiB, 1 MiB requests, queue depth 8)\n",
                  p.write_gbps, p.read_gbps, static_cast<double>(measured_bytes) / (1 << 20));
  }
  if (p.usable || !p.stores.empty()) out += stores_text(p.stores);  // a path that failed early was not looked into
  return out + format("  verdict         %s\n", p.verdict.c_str());
}

void report_probe(Report& report, const SwapPathProbe& p, std::size_t measured_bytes) {
  JsonLine line;
  line.add("path", p.path).add("fs", p.fs_type).add("direct_io", p.direct)
      .add("logical_block", static_cast<std::uint64_t>(p.logical_block))
      .add("dio_alignment", static_cast<std::uint64_t>(p.dio_alignment)).add("free_bytes", p.free_bytes)
      .add("write_gbps", p.write_gbps).add("read_gbps", p.read_gbps).add("usable", p.usable)
      .add_json("swap_stores", stores_json(p.stores)).add("verdict", p.verdict);
  report.result(line, probe_text(p, measured_bytes));
}

}  // namespace

Status measure_path(const std::string& path, std::size_t bytes, double* write_gbps, double* read_gbps) {
  const SwapPathProbe p = probe_swap_path(path, bytes);
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
    const SwapPathProbe p = probe_swap_path(path, rounded);
    if (!p.usable) status = 1;
    report_probe(report, p, rounded);
  }
  return status;
}

}  // namespace zoe::cli
