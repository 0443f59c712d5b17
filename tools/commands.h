// The zoe subcommands. Each takes the arguments after its name and returns the process exit status.
#pragma once

#include <span>

namespace zoe::cli {

int bench_accumulate(std::span<char* const> args);
int bench_adam(std::span<char* const> args);
int bench_nvme(std::span<char* const> args);
int bench_step(std::span<char* const> args);
int bench_param_offload(std::span<char* const> args);  // bench step --offload-param
int export_checkpoint(std::span<char* const> args);
int plan(std::span<char* const> args);
int probe(std::span<char* const> args);

}  // namespace zoe::cli
