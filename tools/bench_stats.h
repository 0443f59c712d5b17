// Timing summaries for the zoe benchmarks: medians with min and max (BENCHMARKING.md).
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace zoe::cli {

struct TimeSummary {
  double median = 0, min = 0, max = 0;
};

inline TimeSummary summarize(std::vector<double> seconds) {
  if (seconds.empty()) return {};
  std::sort(seconds.begin(), seconds.end());
  const std::size_t n = seconds.size();
  const double median = n % 2 ? seconds[n / 2] : 0.5 * (seconds[n / 2 - 1] + seconds[n / 2]);
  return {median, seconds.front(), seconds.back()};
}

template <typename F>
double time_seconds(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace zoe::cli
