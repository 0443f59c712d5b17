// zoe export CHECKPOINT... --out DIR [--moments]: the fp32 master weights of an optimizer checkpoint — every
// rank's partition joined — by parameter name as safetensors (model.safetensors; with --moments also
// exp_avg.safetensors and exp_avg_sq.safetensors), loadable with safetensors.torch.load_file and a model's
// load_state_dict. Each checkpoint's blobs are checked against their checksums; the ranks must be one run's,
// each once.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/files.h"
#include "base/process_identity.h"
#include "tools/args.h"
#include "tools/commands.h"
#include "src/offload/checkpoint.h"

namespace zoe::cli {
namespace {

using Json = nlohmann::json;

struct UserParam {
  std::size_t n = 0;
  std::string name;
  std::vector<std::int64_t> shape;
  bool operator==(const UserParam&) const = default;
};

struct Piece {
  std::size_t param, begin, n;
};

struct RankFile {
  std::string path;
  int rank = 0, world = 1;
  std::int64_t step = 0;
  std::vector<UserParam> params;
  std::vector<Piece> pieces;  // in the order of the state arrays
  std::size_t elements = 0;
};

Status os_error(const std::string& what) {
  const int e = errno;
  return Status(StatusCode::io_error, what + ": " + std::strerror(e), e);
}

Status malformed(const std::string& path, const std::string& what) {
  return Status(StatusCode::corrupt, "checkpoint " + path + ": " + what);
}

std::vector<UserParam> read_params(const Json& list) {
  std::vector<UserParam> out;
  for (const Json& p : list) {
    UserParam u;
    u.n = p.at("n").get<std::size_t>();
    if (p.contains("name")) u.name = p.at("name").get<std::string>();
    if (p.contains("shape")) u.shape = p.at("shape").get<std::vector<std::int64_t>>();
    out.push_back(u);
  }
  return out;
}

Result<RankFile> describe(const std::string& path, const CheckpointReader& reader) {
  const Json m = Json::parse(reader.manifest(), nullptr, false);
  if (m.is_discarded() || m.value("format", "") != "zoe-offload-optimizer") {
    return malformed(path, "not a zoe optimizer checkpoint (its manifest is not one)");
  }
  RankFile f;
  f.path = path;
  try {
    f.step = m.at("step").get<std::int64_t>();
    const Json& part = m.at("partition");
    f.rank = part.at("rank").get<int>();
    f.world = part.at("world").get<int>();
    if (f.world == 1) {
      f.params = read_params(m.at("params"));
      for (std::size_t i = 0; i < f.params.size(); ++i) f.pieces.push_back({i, 0, f.params[i].n});
    } else {
      if (!part.contains("pieces")) {
        return malformed(path, "rank " + std::to_string(f.rank) + " of " + std::to_string(f.world) +
                                   ", written before zoe recorded how partitions join; it cannot be exported");
      }
      f.params = read_params(part.at("params"));
      for (const Json& k : part.at("pieces")) {
        f.pieces.push_back({k.at("param").get<std::size_t>(), k.at("begin").get<std::size_t>(), k.at("n").get<std::size_t>()});
      }
    }
  } catch (const Json::exception& e) {
    return malformed(path, std::string("its manifest is malformed (") + e.what() + ")");
  }
  for (const Piece& k : f.pieces) {
    if (k.param >= f.params.size() || k.begin > f.params[k.param].n || k.n > f.params[k.param].n - k.begin) {
      return malformed(path, "a piece lies outside its parameter");
    }
    f.elements += k.n;
  }
  return f;
}

// What killed exports left beside `path` (`<name>.tmp-<scope>-<pid>`, a model's size each): removed when
// their writer is gone from this scope. Writers of other scopes (hosts, containers) are never judged.
void remove_abandoned_exports(const std::string& path) {
  const std::filesystem::path target(path);
  const std::string prefix = target.filename().string() + ".tmp-";
  std::error_code ec;
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with(prefix)) continue;
    const std::string rest = name.substr(prefix.size());
    const std::size_t dash = rest.find('-');
    if (dash == std::string::npos || rest.find_first_not_of("0123456789", dash + 1) != std::string::npos ||
        dash + 1 == rest.size() || rest.size() - dash > 11) {
      continue;
    }
    const ProcessIdentity writer{"", rest.substr(0, dash), std::stoll(rest.substr(dash + 1))};
    if (liveness(writer) == Liveness::gone) ::unlink(it->path().c_str());
  }
}

// safetensors: an 8-byte little-endian header length, the JSON header (padded with spaces so that the data
// starts 8-byte aligned), then the tensors' bytes back to back. Written beside `path` and renamed over it.
Status write_safetensors(const std::string& path, const std::vector<std::string>& names,
                         const std::vector<std::vector<std::int64_t>>& shapes, const std::vector<std::vector<float>>& data) {
  Json header = Json::object();
  std::size_t offset = 0;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::size_t bytes = data[i].size() * 4;
    header[names[i]] = {{"dtype", "F32"}, {"shape", shapes[i]}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {{"format", "pt"}, {"written_by", "zoe export"}};
  std::string text = header.dump();
  text.resize((text.size() + 8 + 7) / 8 * 8 - 8, ' ');
  remove_abandoned_exports(path);
  const ProcessIdentity self = this_process();
  // One name per process (remove_abandoned_exports reads the writer from it): reused, not exclusive.
  const std::string tmp = path + ".tmp-" + self.scope + "-" + std::to_string(self.pid);
  Result<AtomicFile> file = AtomicFile::create(path, tmp, AtomicFile::Options{0644, false});
  if (!file.ok()) return file.status();
  unsigned char len[8];
  for (int b = 0; b < 8; ++b) len[b] = static_cast<unsigned char>(static_cast<std::uint64_t>(text.size()) >> (8 * b));
  Status s = file->write(len, 8);
  if (s.ok()) s = file->write(text.data(), text.size());
  for (std::size_t i = 0; i < data.size() && s.ok(); ++i) s = file->write(data[i].data(), data[i].size() * 4);
  return s.ok() ? file->commit() : s;
}

}  // namespace

int export_checkpoint(std::span<char* const> args) {
  std::string out;
  bool moments = false, help = false;
  std::vector<std::string> paths;
  std::vector<char*> options_args;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string_view a = args[i];
    if (a.starts_with("--")) {
      options_args.push_back(args[i]);
      if (a == "--out" && i + 1 < args.size()) options_args.push_back(args[++i]);
    } else {
      paths.emplace_back(a);
    }
  }
  const Option options[] = {
      {"out", &out, nullptr, "folder for model.safetensors (and the moments)"},
      {"moments", nullptr, &moments, "also exp_avg.safetensors and exp_avg_sq.safetensors"},
      {"help", nullptr, &help, "this text"},
  };
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "zoe export: %s\n", s.message().c_str());
    return s.code() == StatusCode::invalid_argument ? 2 : 1;
  };
  if (Status s = parse_options(options_args, options); !s.ok()) return fail(s);
  if (help || paths.empty() || out.empty()) {
    std::printf("usage: zoe export CHECKPOINT... --out DIR [--moments]\n\n"
                "Writes the fp32 master weights of a zoe optimizer checkpoint (the files OffloadOptimizer::save()\n"
                "writes; a partitioned run's: every rank's file) by parameter name as safetensors.\n\n%s",
                options_help(options).c_str());
    if (help) return 0;
    return fail(invalid_argument(paths.empty() ? "no CHECKPOINT given" : "--out DIR is required"));
  }
  std::vector<CheckpointReader> readers;
  std::vector<RankFile> files;
  for (const std::string& p : paths) {
    Result<CheckpointReader> r = CheckpointReader::open(p);
    if (!r.ok()) return fail(r.status());
    Result<RankFile> f = describe(p, r.value());
    if (!f.ok()) return fail(f.status());
    readers.push_back(std::move(r).value());
    files.push_back(std::move(f).value());
  }
  // One run's ranks, each once, over the same parameters at the same step.
  const int world = files[0].world;
  std::map<int, std::string> by_rank;
  for (const RankFile& f : files) {
    if (f.world != world) {
      return fail(invalid_argument(f.path + " is a checkpoint of " + std::to_string(f.world) + " ranks, " + files[0].path +
                                   " of " + std::to_string(world) + ": give one run's checkpoints"));
    }
    if (!by_rank.emplace(f.rank, f.path).second) {
      return fail(invalid_argument(f.path + " and " + by_rank[f.rank] + " are both rank " + std::to_string(f.rank)));
    }
    if (f.params != files[0].params || f.step != files[0].step) {
      return fail(invalid_argument(f.path + " and " + files[0].path + " are not of one run (their parameters or steps differ)"));
    }
  }
  for (int r = 0; r < world; ++r) {
    if (!by_rank.count(r)) {
      return fail(invalid_argument("rank " + std::to_string(r) + " of " + std::to_string(world) +
                                   " is missing: give every rank's checkpoint"));
    }
  }
  const std::vector<UserParam>& params = files[0].params;
  std::vector<std::string> names;
  std::vector<std::vector<std::int64_t>> shapes;
  std::map<std::string, std::size_t> seen;
  for (std::size_t i = 0; i < params.size(); ++i) {
    names.push_back(params[i].name.empty() ? "param." + std::to_string(i) : params[i].name);
    shapes.push_back(params[i].shape.empty() ? std::vector<std::int64_t>{static_cast<std::int64_t>(params[i].n)} : params[i].shape);
    if (!seen.emplace(names.back(), i).second) {
      return fail(invalid_argument("parameters " + std::to_string(seen[names.back()]) + " and " + std::to_string(i) +
                                   " are both named '" + names.back() + "'"));
    }
  }
  const char* blobs[3] = {"master", "exp_avg", "exp_avg_sq"};
  const char* outputs[3] = {"model.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors"};
  // Every blob to be exported is checked against its checksum before any file is written.
  for (std::size_t f = 0; f < files.size(); ++f) {
    for (int k = 0; k < (moments ? 3 : 1); ++k) {
      const Status s = readers[f].read_streamed(blobs[k], files[f].elements * 4, CheckpointWriter::kStreamSlice,
                                                [](std::size_t, const void*, std::size_t) { return Status::success(); });
      if (!s.ok()) return fail(s);
    }
  }
  if (::mkdir(out.c_str(), 0755) != 0 && errno != EEXIST) return fail(os_error("cannot create " + out));
  for (int k = 0; k < (moments ? 3 : 1); ++k) {
    std::vector<std::vector<float>> data(params.size());
    std::vector<std::size_t> filled(params.size(), 0);
    for (std::size_t i = 0; i < params.size(); ++i) data[i].resize(params[i].n);
    for (std::size_t f = 0; f < files.size(); ++f) {
      std::vector<float> all(files[f].elements);
      if (Status s = readers[f].read(blobs[k], all.data(), all.size() * 4); !s.ok()) return fail(s);
      std::size_t at = 0;
      for (const Piece& p : files[f].pieces) {
        std::memcpy(data[p.param].data() + p.begin, all.data() + at, p.n * 4);
        filled[p.param] += p.n;
        at += p.n;
      }
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (filled[i] != params[i].n) {
        return fail(Status(StatusCode::corrupt, "parameter " + names[i] + ": the checkpoints hold " + std::to_string(filled[i]) +
                                                    " of its " + std::to_string(params[i].n) + " elements"));
      }
    }
    const std::string path = out + "/" + outputs[k];
    if (Status s = write_safetensors(path, names, shapes, data); !s.ok()) return fail(s);
    std::printf("wrote %s: %zu tensors (%s of %zu parameters, step %lld, from %zu checkpoint%s)\n", path.c_str(),
                params.size(), k == 0 ? "fp32 master weights" : blobs[k], params.size(),
                static_cast<long long>(files[0].step), files.size(), files.size() == 1 ? "" : "s");
  }
  return 0;
}

}  // namespace zoe::cli
