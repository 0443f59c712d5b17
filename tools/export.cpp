// zoe export CHECKPOINT... --out DIR [--moments]: the fp32 master weights of an optimizer checkpoint — every
// rank's partition joined — by parameter name as safetensors (model.safetensors; with --moments also
// exp_avg.safetensors and exp_avg_sq.safetensors), loadable with safetensors.torch.load_file and a model's
// load_state_dict. Each checkpoint's blobs are checked against their checksums; the ranks must be one run's,
// each once.

#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "tools/args.h"
#include "tools/commands.h"
#include "tools/report.h"
#include "zoe/checkpoint.h"

namespace zoe::cli {
namespace {

// ---- The command -------------------------------------------------------------------------------------------

struct Args {
  std::vector<std::string> paths;
  std::string out;
  bool moments = false, help = false;
};

std::array<Option, 3> options_of(Args& a) {
  return {{
      {"out", &a.out, nullptr, "folder for model.safetensors (and the moments)"},
      {"moments", nullptr, &a.moments, "also each state array: exp_avg.safetensors and exp_avg_sq.safetensors (Adam), exp_avg.safetensors (Lion), sum.safetensors (Adagrad)"},
      {"help", nullptr, &a.help, "this text"},
  }};
}

// The words that are not options are the checkpoints; --out takes the word after it.
std::vector<char*> split_paths(std::span<char* const> args, Args& a) {
  std::vector<char*> options_args;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string_view word = args[i];
    if (word.starts_with("--")) {
      options_args.push_back(args[i]);
      if (word == "--out" && i + 1 < args.size()) options_args.push_back(args[++i]);
    } else {
      a.paths.emplace_back(word);
    }
  }
  return options_args;
}

// Every blob to be exported is checked against its checksum before any file is written; then each is joined,
// written and reported in turn.
Status run(const Args& a, Report& report) {
  Result<PartitionedCheckpoint> checkpoint = PartitionedCheckpoint::open(a.paths);
  if (!checkpoint.ok()) return checkpoint.status();
  // The master as model.safetensors, and with --moments each state array of the run's optimizer as
  // <state>.safetensors (Adam: exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad; Lion: exp_avg;
  // Adagrad: sum).
  std::vector<std::string> names = {"master"};
  std::vector<ExportFile> outputs = {{"master", "model.safetensors"}};
  for (const std::string& state : checkpoint->state_names()) names.push_back(state);
  for (std::size_t k = 1; k < names.size(); ++k) outputs.push_back({names[k].c_str(), names[k] + ".safetensors"});
  std::vector<const char*> blobs;
  for (const std::string& n : names) blobs.push_back(n.c_str());
  const std::size_t count = a.moments ? names.size() : 1;
  if (Status s = checkpoint->verify(std::span<const char* const>(blobs.data(), count)); !s.ok()) return s;
  const std::size_t params = checkpoint->params().size(), files = checkpoint->files();
  return export_safetensors(*checkpoint, std::span<const ExportFile>(outputs.data(), count), a.out,
                            [&](const std::string& path, std::size_t k) {
                              report.lines(format("wrote %s: %zu tensors (%s of %zu parameters, step %lld, from %zu "
                                                  "checkpoint%s)\n", path.c_str(), params,
                                                  k == 0 ? "fp32 master weights" : blobs[k], params,
                                                  static_cast<long long>(checkpoint->step()), files,
                                                  files == 1 ? "" : "s"));
                            });
}

}  // namespace

int export_checkpoint(std::span<char* const> args) {
  constexpr std::string_view kCommand = "zoe export";
  Args a;
  const auto options = options_of(a);
  const std::vector<char*> options_args = split_paths(args, a);
  if (Status s = parse_options(options_args, options); !s.ok()) return fail_message(kCommand, s);
  if (a.help || a.paths.empty() || a.out.empty()) {
    print_help("usage: zoe export CHECKPOINT... --out DIR [--moments]\n\n"
               "Writes the fp32 master weights of a zoe optimizer checkpoint (the files OffloadOptimizer::save()\n"
               "writes; a partitioned run's: every rank's file) by parameter name as safetensors.\n\n",
               options, "");
    if (a.help) return 0;
    return fail_message(kCommand, invalid_argument(a.paths.empty() ? "no CHECKPOINT given" : "--out DIR is required"));
  }
  Report report(kCommand, false);
  if (Status s = run(a, report); !s.ok()) return fail_message(kCommand, s);
  return 0;
}

}  // namespace zoe::cli
