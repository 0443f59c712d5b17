// Which process wrote a file, recorded so that another process can later tell whether that writer still
// runs (to clean up after a crash without ever touching a live writer's file). A pid means something only
// under the kernel boot and PID namespace it came from: a folder on shared storage, or one bind-mounted into
// containers, sees writers whose pids name unrelated processes here. So the record carries a scope naming
// both, and a writer from another scope is never judged — only its own scope can say it is gone.
#pragma once

#include "base/private.h"

#include <cstdint>
#include <string>

namespace zoe {

struct ProcessIdentity {
  std::string host;   // gethostname(), for people: cluster nodes and containers often share one
  std::string scope;  // 16 hex digits: a hash of this boot's id and the PID namespace; "" when unknown
  std::int64_t pid = 0;
};

// This process. Host and scope are computed once; the pid is asked for each time (a fork keeps the cache).
ProcessIdentity this_process();

enum class Liveness {
  running,  // the pid exists in this scope (or may be a reused pid: treated as running all the same)
  gone,     // the pid does not exist in this scope: the writer died or exited
  unknown,  // another scope (host, container, boot), or a scope this process cannot name
};
Liveness liveness(const ProcessIdentity& writer);

// "pid 123 on host gpu7"
std::string describe(const ProcessIdentity& who);

// A host name made safe for a file name: [A-Za-z0-9._-] kept, anything else '_', at most 32 characters.
std::string file_name_host(const std::string& host);

}  // namespace zoe
