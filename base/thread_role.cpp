#include "base/thread_role.h"

namespace zoe {
namespace {

thread_local bool t_worker = false;

}  // namespace

void mark_worker_thread() noexcept { t_worker = true; }
bool on_worker_thread() noexcept { return t_worker; }

}  // namespace zoe
