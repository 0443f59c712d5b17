#include "aio/swap_inventory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <filesystem>

#include "aio/files.h"

namespace zoe::aio {
namespace {

constexpr std::string_view kManifestSuffix = ".zoe-swap.json";

// Whether some process holds the store's tile table open (its shared lock): an exclusive lock is refused.
bool table_locked(const std::string& table) {
  FileHandle fd(::open(table.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return false;
  return ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
}

std::uint64_t add_if_present(const std::string& path, std::vector<std::string>& files) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return 0;
  if (std::find(files.begin(), files.end(), path) != files.end()) return 0;
  files.push_back(path);
  return static_cast<std::uint64_t>(st.st_size);
}

void judge(FoundStore& s, bool locked, const std::optional<ProcessIdentity>& owner) {
  if (locked) {
    s.state = StoreState::in_use;
    s.who = owner ? "in use by " + describe(*owner) : "in use (a process holds it open)";
    return;
  }
  if (!owner) {
    s.state = StoreState::unknown;
    s.who = "no owner recorded (made by an older zoe) and not held open by a current one: cannot tell whether a run "
            "still uses it";
    return;
  }
  switch (liveness(*owner)) {
    case Liveness::running:
      s.state = StoreState::in_use;
      s.who = "not held open, but its owner " + describe(*owner) + " is running (done with it, or a reused pid): "
              "remove it once that process ends";
      return;
    case Liveness::gone:
      s.state = StoreState::abandoned;
      s.who = "left by " + describe(*owner) + ", which is not running";
      return;
    case Liveness::unknown:
      s.state = StoreState::unknown;
      s.who = "made by " + describe(*owner) + ", another host or container: cannot tell from here whether it runs";
      return;
  }
}

std::string shell_quote(const std::string& s) {
  const bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::string_view("._/+-=:@,").find(c) != std::string_view::npos;
  });
  if (plain) return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace

nlohmann::json owner_record() {
  const ProcessIdentity self = this_process();
  return {{"host", self.host}, {"scope", self.scope}, {"pid", self.pid}};
}

std::optional<ProcessIdentity> parse_owner(const nlohmann::json& manifest) {
  const auto it = manifest.find("owner");
  if (it == manifest.end() || !it->is_object()) return std::nullopt;
  const nlohmann::json& o = *it;
  if (!o.contains("pid") || !o["pid"].is_number_integer()) return std::nullopt;
  return ProcessIdentity{o.value("host", std::string()), o.value("scope", std::string()), o["pid"].get<std::int64_t>()};
}

void mark_in_use(int table_fd) {
  int r;
  do {
    r = ::flock(table_fd, LOCK_SH);  // waits only while a probe holds its momentary exclusive test lock
  } while (r != 0 && errno == EINTR);
}

std::vector<FoundStore> find_swap_stores(const std::string& dir) {
  std::vector<FoundStore> found;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    if (file.size() <= kManifestSuffix.size() || !file.ends_with(kManifestSuffix)) continue;
    FoundStore s;
    s.name = file.substr(0, file.size() - kManifestSuffix.size());
    s.manifest = it->path().string();
    Result<std::string> text = read_whole_file(s.manifest);
    const nlohmann::json m = text.ok() ? nlohmann::json::parse(text.value(), nullptr, false) : nlohmann::json();
    std::vector<std::string> paths;
    std::error_code canon_ec;
    if (m.is_object() && m.contains("paths") && m["paths"].is_array()) {
      for (const auto& p : m["paths"]) {
        if (p.is_string()) paths.push_back(p.get<std::string>());
      }
    }
    if (std::find(paths.begin(), paths.end(), dir) == paths.end() &&
        std::find(paths.begin(), paths.end(), std::filesystem::weakly_canonical(dir, canon_ec).string()) == paths.end()) {
      paths.push_back(dir);  // moved or copied here: at least its files in this folder
    }
    const std::string base = "/" + s.name + ".zoe-swap";
    s.bytes += add_if_present(s.manifest, s.files);
    for (const std::string& p : paths) s.bytes += add_if_present(p + base + ".json", s.files);
    for (const std::string& p : paths) s.bytes += add_if_present(p + base + ".json.tmp", s.files);
    for (const std::string& p : paths) s.bytes += add_if_present(p + base + ".table", s.files);
    for (const std::string& p : paths) s.bytes += add_if_present(p + base, s.files);
    const bool locked = table_locked(paths.front() + base + ".table");
    judge(s, locked, m.is_object() ? parse_owner(m) : std::nullopt);
    if (!m.is_object()) s.who = "manifest " + s.manifest + " is not readable JSON; " + s.who;
    found.push_back(std::move(s));
  }
  std::sort(found.begin(), found.end(), [](const FoundStore& a, const FoundStore& b) { return a.name < b.name; });
  return found;
}

std::string remove_command(const FoundStore& store) {
  std::string cmd = "rm";
  for (const std::string& f : store.files) cmd += " " + shell_quote(f);
  return cmd;
}

}  // namespace zoe::aio
