// zoe export CHECKPOINT... --out DIR [--moments]: the fp32 master weights of an optimizer checkpoint — every
// rank's partition joined — by parameter name as safetensors (model.safetensors; with --moments also
// exp_avg.safetensors and exp_avg_sq.safetensors), loadable with safetensors.torch.load_file and a model's
// load_state_dict. Each checkpoint's blobs are checked against their checksums; the ranks must be one run's,
// each once.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/files.h"
#include "base/process_identity.h"
#include "tools/args.h"
#include "tools/commands.h"
#include "tools/report.h"
#include "zoe/checkpoint.h"

namespace zoe::cli {
namespace {

using Json = nlohmann::json;

// ---- Writing safetensors ----------------------------------------------------------------------------------

Status os_error(const std::string& what) {
  const int e = errno;
  return Status(StatusCode::io_error, what + ": " + std::strerror(e), e);
}

// What killed exports left beside `name` in `folder` (`<name>.tmp-<scope>-<pid>-<random>`, a model's size
// each): removed when their writer is gone from this scope. Writers of other scopes (hosts, containers) are
// never judged. Removed through the folder's descriptor: a link there goes, never what it points to.
void remove_abandoned_exports(const Folder& folder, const std::string& name) {
  const std::string prefix = name + ".tmp-";
  std::error_code ec;
  for (std::filesystem::directory_iterator it(folder.path(), ec), end; !ec && it != end; it.increment(ec)) {
    const std::string found = it->path().filename().string();
    if (!found.starts_with(prefix)) continue;
    const std::string rest = found.substr(prefix.size());  // <scope>-<pid>-<random>
    const std::size_t dash = rest.find('-'), last = rest.rfind('-');
    if (dash == std::string::npos || last <= dash + 1 || last - dash - 1 > 10 ||
        rest.find_first_not_of("0123456789", dash + 1) != last) {
      continue;
    }
    const ProcessIdentity writer{"", rest.substr(0, dash), std::stoll(rest.substr(dash + 1, last - dash - 1))};
    if (liveness(writer) == Liveness::gone) (void)folder.remove(found);
  }
}

// safetensors: an 8-byte little-endian header length, the JSON header (padded with spaces so that the data
// starts 8-byte aligned), then the tensors' bytes back to back. Written beside `path` and renamed over it.
Status write_safetensors(const Folder& folder, const std::string& name, const std::vector<CheckpointParam>& params,
                         const std::vector<std::vector<float>>& data) {
  Json header = Json::object();
  std::size_t offset = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::size_t bytes = data[i].size() * 4;
    header[params[i].name] = {{"dtype", "F32"}, {"shape", params[i].shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {{"format", "pt"}, {"written_by", "zoe export"}};
  std::string text = header.dump();
  text.resize((text.size() + 8 + 7) / 8 * 8 - 8, ' ');
  remove_abandoned_exports(folder, name);
  const ProcessIdentity self = this_process();
  // The writer in the temporary's name (remove_abandoned_exports reads it), then AtomicFile's random part.
  // Mode 0666 and the umask, as torch.save's files.
  Result<AtomicFile> file =
      AtomicFile::create_in(folder, name, AtomicFile::Options{0666, self.scope + "-" + std::to_string(self.pid)});
  if (!file.ok()) return file.status();
  unsigned char len[8];
  for (int b = 0; b < 8; ++b) len[b] = static_cast<unsigned char>(static_cast<std::uint64_t>(text.size()) >> (8 * b));
  Status s = file->write(len, 8);
  if (s.ok()) s = file->write(text.data(), text.size());
  for (std::size_t i = 0; i < data.size() && s.ok(); ++i) s = file->write(data[i].data(), data[i].size() * 4);
  return s.ok() ? file->commit() : s;
}

// ---- The command -------------------------------------------------------------------------------------------

struct Args {
  std::vector<std::string> paths;
  std::string out;
  bool moments = false, help = false;
};

std::array<Option, 3> options_of(Args& a) {
  return {{
      {"out", &a.out, nullptr, "folder for model.safetensors (and the moments)"},
      {"moments", nullptr, &a.moments, "also exp_avg.safetensors and exp_avg_sq.safetensors"},
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
  const char* blobs[3] = {"master", "exp_avg", "exp_avg_sq"};
  const char* outputs[3] = {"model.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors"};
  const std::size_t count = a.moments ? 3 : 1;
  Result<PartitionedCheckpoint> checkpoint = PartitionedCheckpoint::open(a.paths);
  if (!checkpoint.ok()) return checkpoint.status();
  if (Status s = checkpoint->verify(std::span<const char* const>(blobs, count)); !s.ok()) return s;
  if (::mkdir(a.out.c_str(), 0777) != 0 && errno != EEXIST) return os_error("cannot create " + a.out);
  Result<Folder> folder = Folder::open(a.out);  // opened once: every file below is written through it
  if (!folder.ok()) return folder.status();
  const std::size_t params = checkpoint->params().size(), files = checkpoint->files();
  for (std::size_t k = 0; k < count; ++k) {
    Result<std::vector<std::vector<float>>> data = checkpoint->join(blobs[k]);
    if (!data.ok()) return data.status();
    const std::string path = folder->path_of(outputs[k]);
    if (Status s = write_safetensors(*folder, outputs[k], checkpoint->params(), *data); !s.ok()) return s;
    report.lines(format("wrote %s: %zu tensors (%s of %zu parameters, step %lld, from %zu checkpoint%s)\n", path.c_str(),
                        params, k == 0 ? "fp32 master weights" : blobs[k], params,
                        static_cast<long long>(checkpoint->step()), files, files == 1 ? "" : "s"));
  }
  return Status::success();
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
