// Which swap stores a folder holds, and whether a running process still uses each: what `zoe probe` reports
// so that the stores of crashed or finished runs (gigabytes each, never removed by anyone) can be found.
//
// A store says it is in use in two ways, both kept by SwapStore:
//  - its tile table is open with a shared flock for as long as the store is: released by the kernel when the
//    process dies however it dies, so a lock that can be taken exclusively means no process holds the store
//    open (on this machine; NFS passes locks between hosts only where lockd runs);
//  - its manifest records the process that created or last opened it ("owner": host, scope, pid — added to
//    manifest format 1 without a version change: readers ignore fields they do not know), which names the
//    run and, in this scope, says whether it still runs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "src/process_identity.h"

namespace zoe::aio {

// The owner field of a manifest for this process.
nlohmann::json owner_record();
std::optional<ProcessIdentity> parse_owner(const nlohmann::json& manifest);

// Takes the shared lock that marks a store in use, on its tile table, for as long as `table_fd` stays open.
// Best effort: a filesystem without flock leaves the owner record as the only sign.
void mark_in_use(int table_fd);

enum class StoreState {
  in_use,     // its lock is held, or its owner runs in this scope
  abandoned,  // not locked, and its owner is gone from this scope
  unknown,    // not locked, and its owner cannot be judged here (another host or container, or none recorded)
};

struct FoundStore {
  std::string name;
  std::string manifest;             // the manifest found in the folder
  std::vector<std::string> files;   // the store's files that exist, on every path, manifests first
  std::uint64_t bytes = 0;          // their total size
  StoreState state = StoreState::unknown;
  std::string who;                  // "in use by pid 12 on host a", "left by pid 9 on host a, which is not running"
};

// Every `<name>.zoe-swap.json` in `dir`, sorted by name. A manifest that cannot be parsed is reported as a
// store of unknown state with its own files only.
std::vector<FoundStore> find_swap_stores(const std::string& dir);

// A shell command that removes the store (manifests first, so that a store half removed is no longer
// recognised as one), each path quoted where it needs to be.
std::string remove_command(const FoundStore& store);

}  // namespace zoe::aio
