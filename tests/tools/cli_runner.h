// Runs the built `zoe` command as a child and says how it ended: its exit status or the signal that ended it,
// and what it wrote (stdout and stderr together). The suites of tests/tools/ see the command as a user does.
//
// Which binary: $ZOE_CLI when set, else the one this build made (ZOE_CLI_PATH, passed in by tests/meson.build),
// so that the sanitized build (scripts/test-sanitized) runs its own sanitized zoe.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace zoe::test {

inline std::string zoe_cli() {
  const char* env = std::getenv("ZOE_CLI");
  return env != nullptr && *env != '\0' ? std::string(env) : std::string(ZOE_CLI_PATH);
}

struct Ran {
  bool signaled = false;   // ended by a signal (a crash, an abort, the timeout's kill)
  int signal = 0;
  int code = -1;           // the exit status when not signaled
  bool timed_out = false;  // killed after the time allowed
  std::string output;

  std::string how() const {
    if (timed_out) return "killed after the time allowed (hung)";
    if (signaled) return "ended by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
    return "exit " + std::to_string(code);
  }
};

// `args` after the program name; the child runs in `cwd` (when not empty) with stdin from /dev/null.
inline Ran run_zoe(const std::vector<std::string>& args, double timeout_s, const std::string& cwd = "") {
  const std::string program = zoe_cli();
  // Everything the child needs is made before fork: between fork and exec it only calls what is safe in a
  // child of a multi-threaded process.
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(program.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int out[2];
  Ran r;
  if (::pipe2(out, O_CLOEXEC) != 0) {
    r.output = "pipe failed";
    return r;
  }
  const pid_t child = ::fork();
  if (child == 0) {
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, 0);
    ::dup2(out[1], 1);
    ::dup2(out[1], 2);
    if (!cwd.empty() && ::chdir(cwd.c_str()) != 0) ::_exit(127);
    ::execv(program.c_str(), argv.data());
    ::_exit(127);
  }
  ::close(out[1]);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      ::kill(child, SIGKILL);
      break;
    }
    pollfd p{out[0], POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    const ssize_t n = ::read(out[0], buf, sizeof buf);
    if (n <= 0) break;  // every writer closed: the child is ending
    if (r.output.size() < (1 << 20)) r.output.append(buf, static_cast<std::size_t>(n));
  }
  ::close(out[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (WIFSIGNALED(status)) {
    r.signaled = true;
    r.signal = WTERMSIG(status);
  } else if (WIFEXITED(status)) {
    r.code = WEXITSTATUS(status);
  }
  return r;
}

}  // namespace zoe::test
