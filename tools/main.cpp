// zoe — the ZeRO Offload Engine command line.
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <span>
#include <string>
#include <string_view>

#include "tools/commands.h"
#include "zoe/adam.h"

namespace {

using Handler = int (*)(std::span<char* const>);

struct Command {
  std::string_view group, name;
  Handler run;
  std::string_view summary;
};

int info(std::span<char* const>) {
  std::printf("zoe %s\nISAs this CPU runs (best first):", ZOE_VERSION);
  for (zoe::Isa isa : zoe::supported_isas()) std::printf(" %s", std::string(zoe::isa_name(isa)).c_str());
  std::printf("\nCPU features: %s\n", zoe::cpu_features_text().c_str());
  return 0;
}

const Command kCommands[] = {
    {"bench", "adam", zoe::cli::bench_adam, "CPU Adam step throughput against its streams ceiling"},
    {"bench", "accumulate", zoe::cli::bench_accumulate, "gradient accumulation (acc += g) against its streams ceiling"},
    {"bench", "step", zoe::cli::bench_step, "whole offloaded training iterations against the device's compute"},
#ifdef ZOE_HAVE_AIO
    {"bench", "nvme", zoe::cli::bench_nvme, "one optimizer step streamed from NVMe against raw O_DIRECT I/O"},
    {"", "probe", zoe::cli::probe, "check swap paths: filesystem, O_DIRECT, block size, space, bandwidth"},
#endif
    {"", "export", zoe::cli::export_checkpoint, "a checkpoint's fp32 master weights (all ranks joined) as safetensors"},
    {"", "plan", zoe::cli::plan, "size a run: memory per GPU, host and NVMe path, placement, step time, config"},
    {"", "info", info, "the ISAs and CPU features zoe sees"},
};

void usage(std::FILE* out) {
  std::fprintf(out, "usage: zoe COMMAND [options]   (zoe COMMAND --help for its options)\n\ncommands:\n");
  for (const Command& c : kCommands) {
    char name[32];
    std::snprintf(name, sizeof name, "%s%s%s", std::string(c.group).c_str(), c.group.empty() ? "" : " ",
                  std::string(c.name).c_str());
    std::fprintf(out, "  %-16s %s\n", name, std::string(c.summary).c_str());
  }
}

int run(std::span<char* const> args) {
  if (args.empty() || std::strcmp(args[0], "--help") == 0 || std::strcmp(args[0], "-h") == 0) {
    usage(args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  if (std::strcmp(args[0], "--version") == 0) {
    std::printf("zoe %s\n", ZOE_VERSION);
    return 0;
  }
  for (const Command& c : kCommands) {
    if (c.group.empty() && c.name == args[0]) return c.run(args.subspan(1));
    if (!c.group.empty() && c.group == args[0] && args.size() > 1 && c.name == args[1]) return c.run(args.subspan(2));
  }
  std::fprintf(stderr, "zoe: unknown command '%s'\n", args[0]);
  usage(stderr);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  // The commands report errors as Status; an exception reaching here is a bug in zoe or a dependency
  // (nlohmann, the standard library). It is reported like any error, not left to std::terminate's abort.
  try {
    return run(std::span<char* const>(argv + 1, argc - 1));
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "zoe: out of memory\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zoe: internal error: %s (please report it)\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "zoe: internal error: an exception that is not a std::exception (please report it)\n");
  }
  return 1;
}
