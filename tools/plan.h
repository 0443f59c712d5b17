// zoe plan's command, in two files: tools/plan.cpp reads the command line, measures the rates it is not given
// and searches the placements; tools/plan_report.cpp prints what it found (the table by kind, each term's
// bytes and origin, the step estimate, the config). The arithmetic is src/plan/plan.h.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "zoe/plan.h"

namespace zoe::cli::planning {

using plan::Cluster;
using plan::Model;
using plan::Placement;
using plan::Rates;
using plan::Training;
using plan::Usage;
using plan::Verdict;

constexpr double kAssumedPcieGbps = 25;  // PCIe 4.0 x16, what a pinned copy reaches in practice

struct Figure {
  double value = 0;
  std::string how;  // "measured: ...", "given", "assumed: ..."
};

struct Inputs {
  Model model;
  Cluster cluster;
  Training training;
  std::string gpu_mem_how, host_ram_how, capacity_how;
};

struct Evaluated {
  Placement placement;
  Usage usage;
  Verdict verdict;
};

// What is to be planned, read from the command line; the rates given there (the others are measured by run).
struct Request {
  Inputs in;
  bool requested = false;  // a placement was asked for (--stage, --offload-*)
  Placement asked;
  Figure adam, nvme, nvme_write, pcie{kAssumedPcieGbps, "assumed: PCIe 4.0 x16"};  // value 0: not given
};

struct PlanResult {
  std::vector<Evaluated> all;                  // every candidate, least offload first
  std::size_t cheapest = 0, zoe_cheapest = 0;  // the first that fits (and zoe runs); all.size(): none
  Evaluated shown;                             // the one asked for, else the cheapest, else the most offloaded
  Figure adam, nvme, nvme_write, pcie;
  Rates rates;

  const Evaluated* find(std::size_t i) const { return i < all.size() ? &all[i] : nullptr; }
};

// The plan as one JSON object (--json), and as text.
std::string plan_json(const Request& r, const PlanResult& p);
std::string plan_text(const Request& r, const PlanResult& p);

}  // namespace zoe::cli::planning
