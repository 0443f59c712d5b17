// Processes that tests need as witnesses of liveness checks.
#pragma once

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

namespace zoe::test {

// A pid that names no process: a child that has exited and been reaped (only _exit runs in it, so forking a
// multi-threaded test process is safe). The kernel reuses it only after a full turn of the pid space.
inline pid_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return child;
}

}  // namespace zoe::test
