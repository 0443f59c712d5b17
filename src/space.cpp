// Room before allocation (zoe/space.h): what is free on this machine, and the check that compares a part's
// needs with it before the part allocates anything.
#include "zoe/space.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <utility>

namespace zoe {

void SpaceNeed::add_ram(std::string what, std::uint64_t bytes) {
  if (bytes == 0) return;
  ram += bytes;
  for (Part& p : ram_parts) {
    if (p.what == what) {
      p.bytes += bytes;
      return;
    }
  }
  ram_parts.push_back({std::move(what), bytes});
}

void SpaceNeed::add_disk(std::string dir, std::uint64_t bytes, std::vector<std::string> replaces) {
  disk.push_back({std::move(dir), bytes, std::move(replaces)});
}

SpaceNeed& SpaceNeed::operator+=(const SpaceNeed& other) {
  for (const Part& p : other.ram_parts) add_ram(p.what, p.bytes);
  disk.insert(disk.end(), other.disk.begin(), other.disk.end());
  return *this;
}

namespace {

std::mutex override_mutex;
std::optional<FreeSpaceOverride> free_override;

std::optional<FreeSpaceOverride> current_override() {
  const std::lock_guard lock(override_mutex);
  return free_override;
}

// "21.6 GiB (23195869184 bytes)": the rounded figure to read, the exact one to compare.
std::string sized(std::uint64_t bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  if (u == 0) return std::to_string(bytes) + " bytes";
  char text[64];
  std::snprintf(text, sizeof text, "%.1f %s (%llu bytes)", v, units[u], static_cast<unsigned long long>(bytes));
  return text;
}

std::optional<std::uint64_t> read_count(const std::string& file) {
  std::ifstream in(file);
  std::string word;
  if (!(in >> word) || word.empty() || word.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  try {
    return std::stoull(word);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The value of `key` in a "key value" file (memory.stat), or 0.
std::uint64_t stat_field(const std::string& file, const std::string& key) {
  std::ifstream in(file);
  std::string k;
  std::uint64_t v = 0;
  while (in >> k >> v) {
    if (k == key) return v;
  }
  return 0;
}

struct CgroupMount {
  std::string point, root;  // where it is mounted, and which cgroup is its root there
};

// The cgroup v2 mount and v1's memory controller mount, from /proc/self/mountinfo:
// "ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER_OPTIONS".
void find_cgroup_mounts(std::optional<CgroupMount>* v2, std::optional<CgroupMount>* v1) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string x; words >> x;) w.push_back(x);
    const auto dash = std::find(w.begin(), w.end(), "-");
    if (w.size() < 5 || dash == w.end() || w.end() - dash < 4) continue;
    const std::string& type = *(dash + 1);
    const std::string& super = *(dash + 3);
    if (type == "cgroup2" && !*v2) *v2 = CgroupMount{w[4], w[3]};
    if (type == "cgroup" && !*v1 && ("," + super + ",").find(",memory,") != std::string::npos) {
      *v1 = CgroupMount{w[4], w[3]};
    }
  }
}

// The room under the tightest limit from the cgroup `path` (as /proc/self/cgroup names it) up to its mount's
// root: limit - (usage - inactive file pages), the "working set" kubelet and cAdvisor compare with the limit.
void tightest_limit(const CgroupMount& mount, std::string path, bool v2, FreeRam* out) {
  if (path.compare(0, mount.root.size(), mount.root) == 0 && mount.root != "/") path = path.substr(mount.root.size());
  const std::uint64_t unlimited = std::uint64_t(1) << 62;  // v1 writes "no limit" as about 2^63
  while (true) {
    const std::string dir = mount.point + (path == "/" ? "" : path);
    const std::optional<std::uint64_t> limit = read_count(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"));
    const std::optional<std::uint64_t> usage = read_count(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes"));
    if (limit && usage && *limit < unlimited) {
      const std::uint64_t inactive = stat_field(dir + "/memory.stat", v2 ? "inactive_file" : "total_inactive_file");
      const std::uint64_t used = *usage - std::min(*usage, inactive);
      const std::uint64_t room = *limit - std::min(*limit, used);
      if (room < out->bytes) {
        out->bytes = room;
        out->source = "the room under the memory limit of cgroup " + path + " (" + sized(*limit) + ", " + sized(used) +
                      " in use)";
      }
    }
    if (path.empty() || path == "/") break;
    const std::size_t slash = path.find_last_of('/');
    path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
  }
}

}  // namespace

FreeRam free_ram() {
  FreeRam out;
  out.bytes = std::numeric_limits<std::uint64_t>::max();
  if (std::optional<FreeSpaceOverride> o = current_override(); o && o->ram) return {*o->ram, "set by a test"};
  {
    std::ifstream in("/proc/meminfo");
    std::string key;
    std::uint64_t kib = 0;
    std::string unit;
    while (in >> key >> kib) {
      std::getline(in, unit);
      if (key == "MemAvailable:") {
        out.bytes = kib * 1024;
        out.source = "MemAvailable in /proc/meminfo";
        break;
      }
    }
  }
  std::optional<CgroupMount> v2, v1;
  find_cgroup_mounts(&v2, &v1);
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    // "0::/path" (v2), "4:memory:/path" (v1; controllers may be listed together: "4:cpu,memory:/path").
    const std::size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty() && v2) tightest_limit(*v2, path, true, &out);
    if (v1 && ("," + controllers + ",").find(",memory,") != std::string::npos) tightest_limit(*v1, path, false, &out);
  }
  if (out.source.empty()) out.source = "unknown (no MemAvailable in /proc/meminfo)";
  return out;
}

Result<std::uint64_t> free_disk(const std::string& dir) {
  if (std::optional<FreeSpaceOverride> o = current_override(); o && o->disk) return *o->disk;
  struct statvfs fs{};
  if (::statvfs(dir.c_str(), &fs) != 0) {
    return Status(StatusCode::io_error, "statvfs of " + dir + " failed", errno);
  }
  return static_cast<std::uint64_t>(fs.f_bavail) * static_cast<std::uint64_t>(fs.f_frsize);
}

void set_free_space_override(std::optional<FreeSpaceOverride> override_for_tests) {
  const std::lock_guard lock(override_mutex);
  free_override = std::move(override_for_tests);
}

namespace {

Status check_ram(const SpaceNeed& need, std::string_view what, std::string_view plan) {
  if (need.ram == 0) return Status::success();
  const FreeRam free = free_ram();
  if (need.ram <= free.bytes) return Status::success();
  std::string parts;
  for (const SpaceNeed::Part& p : need.ram_parts) parts += (parts.empty() ? "" : ", ") + p.what + " " + sized(p.bytes);
  std::string message(what);
  message += " needs " + sized(need.ram) + " of host RAM (" + parts + "), and " + sized(free.bytes) +
             " are free (" + free.source + "): refused before allocating any of it, rather than being killed by "
             "the kernel for the lack of memory part-way. Size the run with: ";
  message += plan;
  return Status(StatusCode::out_of_memory, message);
}

// What the files `names` in `dir` hold on their disk (regular files only; a link counts nothing).
std::uint64_t replaced_bytes(const std::string& dir, const std::vector<std::string>& names) {
  std::uint64_t total = 0;
  for (const std::string& name : names) {
    struct stat st{};
    const std::string path = dir + "/" + name;
    if (::fstatat(AT_FDCWD, path.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) {
      total += static_cast<std::uint64_t>(st.st_blocks) * 512;
    }
  }
  return total;
}

Status check_disk(const SpaceNeed& need, std::string_view what, std::string_view plan) {
  struct Filesystem {
    std::vector<std::string> dirs;
    std::uint64_t need = 0, replaced = 0;
  };
  std::map<dev_t, Filesystem> filesystems;  // paths on one filesystem share its free space
  for (const SpaceNeed::Disk& d : need.disk) {
    struct stat st{};
    // A path that cannot be reached is left to the creation, whose error names it and says why.
    if (d.bytes == 0 || ::stat(d.dir.c_str(), &st) != 0) continue;
    Filesystem& fs = filesystems[st.st_dev];
    if (std::find(fs.dirs.begin(), fs.dirs.end(), d.dir) == fs.dirs.end()) fs.dirs.push_back(d.dir);
    fs.need += d.bytes;
    fs.replaced += replaced_bytes(d.dir, d.replaces);
  }
  for (const auto& [dev, fs] : filesystems) {
    struct statvfs v{};
    // ramfs reports no size at all: nothing to compare with there.
    if (!current_override() && ::statvfs(fs.dirs[0].c_str(), &v) == 0 && v.f_blocks == 0) continue;
    Result<std::uint64_t> free = free_disk(fs.dirs[0]);
    if (!free.ok()) continue;
    const std::uint64_t room = free.value() + fs.replaced;
    if (fs.need <= room) continue;
    std::string dirs;
    for (const std::string& d : fs.dirs) dirs += (dirs.empty() ? "" : ", ") + d;
    std::string message(what);
    message += " needs " + sized(fs.need) + " of disk for its files under " + dirs + ", and " + sized(room) +
               " are free on that filesystem";
    if (fs.replaced > 0) message += " (counting " + sized(fs.replaced) + " of files it replaces there)";
    message += ": refused before creating any file. Free space there, choose another path, or size the run with: ";
    message += plan;
    return Status(StatusCode::io_error, message, ENOSPC);
  }
  return Status::success();
}

}  // namespace

Status check_space(const SpaceNeed& need, std::string_view what, std::string_view plan) {
  if (Status s = check_ram(need, what, plan); !s.ok()) return s;
  return check_disk(need, what, plan);
}

std::string plan_count(std::uint64_t params) {
  const std::pair<std::uint64_t, const char*> scales[] = {{1000000000000ull, "T"}, {1000000000ull, "B"}, {1000000ull, "M"}};
  for (const auto& [scale, suffix] : scales) {
    if (params < scale) continue;
    char text[32];
    std::snprintf(text, sizeof text, "%.2f%s", static_cast<double>(params) / static_cast<double>(scale), suffix);
    return text;
  }
  return std::to_string(std::max<std::uint64_t>(params, 1));
}

std::string plan_nvme_paths(const std::vector<std::string>& paths) {
  if (paths.empty()) return "";
  std::string out = " --nvme";
  for (const std::string& p : paths) {
    out += " '";
    for (char c : p) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    out += "'";
  }
  return out;
}

}  // namespace zoe
