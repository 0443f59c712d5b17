#include "src/nvme/swap_inventory.h"

#include <fcntl.h>
#include <unistd.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <thread>

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
  // Fields of another type are treated as missing: json's value() would throw on them.
  auto text = [&o](const char* key) {
    const auto f = o.find(key);
    return f != o.end() && f->is_string() ? f->get<std::string>() : std::string();
  };
  return ProcessIdentity{text("host"), text("scope"), o["pid"].get<std::int64_t>()};
}

namespace {

// One folder's owner lock, `<base>.lock`. A lock file removed (by an owner that was done with the files)
// between our open and our flock is not the owner's lock any more: the file at the name is checked to be the
// one locked, else it starts again. Created exclusively or opened as a regular file, never through a link.
Result<FileHandle> open_lock(const Folder& folder, const std::string& name) {
  for (int attempt = 0;; ++attempt) {
    Result<UniqueFd> made = folder.create(name, O_RDWR, 0600);
    if (made.ok() || made.status().sys_errno() != EEXIST) return made;
    Result<UniqueFd> found = folder.open_file(name, O_RDWR);
    if (found.ok() || found.status().sys_errno() != ENOENT || attempt == 50) return found;  // removed meanwhile: again
  }
}

Result<FileHandle> lock_one(const Folder& folder, const std::string& base, const std::string& what) {
  const std::string name = owner_lock_name(base);
  const std::string path = folder.path_of(name);
  // A probe tests the lock for a moment (a shared lock); a few retries step around it.
  for (int attempt = 0;; ++attempt) {
    Result<FileHandle> opened = open_lock(folder, name);
    if (!opened.ok()) return Status(opened.status().code(), "the owner lock of " + what + ": " + opened.status().message(),
                                    opened.status().sys_errno());
    FileHandle fd = std::move(opened).value();
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK) return fd;  // no flock on this filesystem: the owner record is all there is
      if (attempt < 50) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        continue;
      }
      const std::optional<ProcessIdentity> holder = owner_lock_record(path);
      const ProcessIdentity self = this_process();
      const bool here = holder && holder->pid == self.pid && holder->scope == self.scope;
      return Status(StatusCode::io_error,
                    what + " in " + folder.path() + " is in use by " +
                        (holder ? describe(*holder) : std::string("another process (no record in " + path + ")")) +
                        (here ? " — this process: another optimizer (or store) holds it" : "") +
                        ". One store serves one optimizer: give this one another nvme_path, or end the one that "
                        "uses it first (Python: del the optimizer; a process that ends releases it)",
                    EBUSY);
    }
    struct stat held {}, named {};
    if (::fstat(fd.get(), &held) != 0 || ::fstatat(folder.fd(), name.c_str(), &named, AT_SYMLINK_NOFOLLOW) != 0 ||
        held.st_ino != named.st_ino || held.st_dev != named.st_dev) {
      continue;  // removed while we waited for it
    }
    const std::string record = nlohmann::json{{"owner", owner_record()}}.dump() + "\n";
    if (::ftruncate(fd.get(), 0) == 0) (void)!::pwrite(fd.get(), record.data(), record.size(), 0);
    return fd;
  }
}

}  // namespace

Result<std::vector<FileHandle>> take_ownership(const std::vector<Folder>& folders, const std::string& base,
                                               const std::string& what) {
  std::vector<FileHandle> locks;
  for (const Folder& folder : folders) {
    Result<FileHandle> fd = lock_one(folder, base, what);
    if (!fd.ok()) return fd.status();  // the locks taken so far are released here
    locks.push_back(std::move(fd).value());
  }
  return locks;
}

std::string owner_lock_name(const std::string& base) { return base + ".lock"; }

std::string owner_lock_path(const std::string& dir, const std::string& base) { return dir + "/" + owner_lock_name(base); }

std::vector<std::string> manifest_temps(const std::string& dir, const std::string& name) {
  const std::string prefix = name + ".zoe-swap.json.tmp";
  std::vector<std::string> found;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().filename().string().starts_with(prefix)) found.push_back(it->path().filename().string());
  }
  return found;
}

void remove_stale_temps(const Folder& folder, const std::string& name) {
  for (const std::string& temp : manifest_temps(folder.path(), name)) (void)folder.remove(temp);
}

bool owner_lock_held(const std::string& lock_path) {
  FileHandle fd(::open(lock_path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd.valid()) return false;
  return ::flock(fd.get(), LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
}

std::optional<ProcessIdentity> owner_lock_record(const std::string& lock_path) {
  Result<std::string> text = read_whole_file(lock_path);
  if (!text.ok()) return std::nullopt;
  const nlohmann::json j = nlohmann::json::parse(text.value(), nullptr, false);
  return j.is_object() ? parse_owner(j) : std::nullopt;
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
    for (const std::string& p : paths) {
      for (const std::string& temp : manifest_temps(p, s.name)) s.bytes += add_if_present(temp, s.files);
    }
    for (const std::string& p : paths) s.bytes += add_if_present(p + base + ".table", s.files);
    for (const std::string& p : paths) s.bytes += add_if_present(p + base, s.files);
    for (const std::string& p : paths) s.bytes += add_if_present(owner_lock_path(p, s.name + ".zoe-swap"), s.files);
    // The owner lock says it first (and who holds it); a store of an older zoe holds only its table's lock.
    const std::string lock = owner_lock_path(paths.front(), s.name + ".zoe-swap");
    const bool owned = owner_lock_held(lock);
    const bool locked = owned || table_locked(paths.front() + base + ".table");
    std::optional<ProcessIdentity> owner = owned ? owner_lock_record(lock) : std::nullopt;
    if (!owner && m.is_object()) owner = parse_owner(m);
    judge(s, locked, owner);
    if (!m.is_object()) s.who = "manifest " + s.manifest + " is not readable JSON; " + s.who;
    found.push_back(std::move(s));
  }
  std::sort(found.begin(), found.end(), [](const FoundStore& a, const FoundStore& b) { return a.name < b.name; });
  return found;
}

std::string remove_command(const FoundStore& store) {
  std::string cmd = "rm";
  for (const std::string& f : store.files) {
    cmd += ' ';
    cmd += shell_quote(f);
  }
  return cmd;
}

}  // namespace zoe::aio
