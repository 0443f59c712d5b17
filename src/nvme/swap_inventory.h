// Which swap stores a folder holds, and whether a running process still uses each: what `zoe probe` reports
// so that the stores of crashed or finished runs (gigabytes each, never removed by anyone) can be found.
//
// A store says it is in use in three ways, all kept by SwapStore:
//  - its owner lock: `<name>.zoe-swap.lock` in every path, flocked exclusively by the one SwapStore that
//    holds the store, for as long as it does (from create()/open() until it is destroyed), and holding that
//    owner's record. A second opener — in this process or another, Python, CLI or C++ — is refused, naming
//    the holder; the kernel drops the lock when the holder dies however it dies, so the store of a dead
//    process is taken over (on this machine; NFS passes locks between hosts only where lockd runs);
//  - its tile table is open with a shared flock for as long as the store is (what zoe before the owner lock
//    kept; the probe still reads it);
//  - its manifest records the process that created or last opened it ("owner": host, scope, pid — added to
//    manifest format 1 without a version change: readers ignore fields they do not know), which names the
//    run and, in this scope, says whether it still runs.
#pragma once

#include "src/private.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "aio/files.h"
#include "base/process_identity.h"
#include "zoe/status.h"

namespace zoe::aio {

// The owner field of a manifest for this process.
nlohmann::json owner_record();
std::optional<ProcessIdentity> parse_owner(const nlohmann::json& manifest);

// Takes the shared lock that marks a store in use, on its tile table, for as long as `table_fd` stays open.
// Best effort: a filesystem without flock leaves the owner record as the only sign.
void mark_in_use(int table_fd);

// The owner locks of the files `<base>*` in `folders`: `<base>.lock` in each (in order), taken exclusively,
// with this process's record written into them; held while the handles stay open. Refused (io_error, EBUSY)
// while another owner — of this process or another — holds any of them, naming `what` (e.g. "swap store
// rank0"), the folder, the holder and what to do. A filesystem without flock gets no lock (the owner record
// and the table's lock remain).
Result<std::vector<FileHandle>> take_ownership(const std::vector<Folder>& folders, const std::string& base,
                                               const std::string& what);

// `<base>.lock`, and that in `dir`: where take_ownership() keeps the lock of the files `<base>*` in a folder.
std::string owner_lock_name(const std::string& base);
std::string owner_lock_path(const std::string& dir, const std::string& base);

// The names of the manifest temporaries of store `name` in `dir` (`<name>.zoe-swap.json.tmp-<pid>-<random>`,
// replace_file's).
std::vector<std::string> manifest_temps(const std::string& dir, const std::string& name);

// Removes what a crashed writer left of store `name` in `folder`: manifest temporaries (`.json.tmp*`).
// Only its owner calls it, so none of them belongs to a live writer.
void remove_stale_temps(const Folder& folder, const std::string& name);

// Whether a live SwapStore holds the owner lock `lock_path`, and the record it wrote there.
bool owner_lock_held(const std::string& lock_path);
std::optional<ProcessIdentity> owner_lock_record(const std::string& lock_path);

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
