// Whose thread is running: zoe's own workers mark themselves, so that a host wait on one (which overlaps the
// device's work and costs only latency) is told apart from the trainer's (which idles the device). Declared
// for users in zoe/device.h too; defined once, in base/thread_role.cpp.
#pragma once

#include "base/private.h"

namespace zoe {

void mark_worker_thread() noexcept;  // the calling thread is one of zoe's own from now on
bool on_worker_thread() noexcept;

}  // namespace zoe
