#include "base/process_identity.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <fstream>

namespace zoe {
namespace {

// FNV-1a, 64 bits: the scope needs to tell boots and namespaces apart, not to resist an adversary.
std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

// The kernel's random id of this boot (the same in every container on it), and the PID namespace's inode:
// together they say where a pid can be looked up. Either missing (no /proc): no scope, nothing is judged.
std::string current_scope() {
  std::string boot_id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  if (!(in >> boot_id) || boot_id.empty()) return "";
  char ns[64] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  if (n <= 0) return "";
  char out[17];
  std::snprintf(out, sizeof out, "%016llx",
                static_cast<unsigned long long>(fnv1a(boot_id + "|" + std::string(ns, static_cast<std::size_t>(n)))));
  return out;
}

}  // namespace

ProcessIdentity this_process() {
  static const ProcessIdentity cached = [] {
    ProcessIdentity p;
    char host[HOST_NAME_MAX + 1] = {};
    if (::gethostname(host, sizeof host - 1) == 0) p.host = host;
    if (p.host.empty()) p.host = "unknown";
    p.scope = current_scope();
    return p;
  }();
  ProcessIdentity self = cached;
  self.pid = static_cast<std::int64_t>(::getpid());
  return self;
}

Liveness liveness(const ProcessIdentity& writer) {
  const ProcessIdentity self = this_process();
  if (self.scope.empty() || writer.scope != self.scope || writer.pid <= 0 || writer.pid > INT_MAX) {
    return Liveness::unknown;
  }
  if (writer.pid == self.pid) return Liveness::running;
  if (::kill(static_cast<pid_t>(writer.pid), 0) == 0) return Liveness::running;
  if (errno == EPERM) return Liveness::running;  // exists, owned by another user
  return errno == ESRCH ? Liveness::gone : Liveness::unknown;
}

std::string describe(const ProcessIdentity& who) {
  return "pid " + std::to_string(who.pid) + " on host " + (who.host.empty() ? "unknown" : who.host);
}

std::string file_name_host(const std::string& host) {
  std::string out;
  for (char c : host.substr(0, 32)) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                      c == '_' || c == '-';
    out += keep ? c : '_';
  }
  return out.empty() ? "unknown" : out;
}

}  // namespace zoe
