// `zoe export`'s writer (zoe/checkpoint.h, export_safetensors): a run's joined fp32 arrays as safetensors,
// written beside the file and renamed over it.
#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "base/files.h"
#include "base/process_identity.h"
#include "zoe/checkpoint.h"

namespace zoe {
namespace {

using Json = nlohmann::json;

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

}  // namespace

Status export_safetensors(const PartitionedCheckpoint& checkpoint, std::span<const ExportFile> files,
                          const std::string& dir, const std::function<void(const std::string&, std::size_t)>& written) {
  if (::mkdir(dir.c_str(), 0777) != 0 && errno != EEXIST) {
    const int e = errno;
    return Status(StatusCode::io_error, "cannot create " + dir + ": " + std::strerror(e), e);
  }
  Result<Folder> folder = Folder::open(dir);  // opened once: every file below is written through it
  if (!folder.ok()) return folder.status();
  for (std::size_t k = 0; k < files.size(); ++k) {
    Result<std::vector<std::vector<float>>> data = checkpoint.join(files[k].blob);
    if (!data.ok()) return data.status();
    if (Status s = write_safetensors(*folder, files[k].name, checkpoint.params(), *data); !s.ok()) return s;
    if (written) written(folder->path_of(files[k].name), k);
  }
  return Status::success();
}

}  // namespace zoe
