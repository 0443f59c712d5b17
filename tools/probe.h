// zoe probe's bandwidth test, for the other commands that need a path's figures (zoe plan).
#pragma once

#include <cstddef>
#include <string>

#include "zoe/status.h"

namespace zoe::cli {

// Writes then reads `bytes` (a multiple of 1 MiB) in a scratch file under `path` through the libaio engine,
// as zoe probe does; an unusable path is an error saying why.
Status measure_path(const std::string& path, std::size_t bytes, double* write_gbps, double* read_gbps);

}  // namespace zoe::cli
