// The state behind OffloadOptimizer and the two seams it is cut along:
//  - StateTier: where the fp32 master weights and moments live (tier_ram.cpp, tier_nvme.cpp);
//  - StepSchedule: how a step meets the device's forward/backward (schedule_sync.cpp, schedule_overlap.cpp,
//    schedule_delayed.cpp).
// Impl holds what every schedule and tier shares: the parameters cut into pieces, the device staging, the
// gradient statistics and the step decision (optimizer_step.cpp). Partitioning is partition.cpp; save/load
// optimizer_io.cpp.
#pragma once

#include "src/private.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/work_queue.h"
#include "src/offload/grad_spill.h"
#include "src/offload/loss_scaler.h"
#include "zoe/aligned_buffer.h"
#include "zoe/offload.h"
#include "zoe/param_tier.h"
#include "zoe/partition.h"

namespace zoe {

class CheckpointReader;
class CheckpointWriter;

// The blobs of i8 moments in a checkpoint: m codes, v codes, m block scales, v block scales.
inline constexpr const char* kQ8Blobs[4] = {"exp_avg_q8", "exp_avg_sq_q8", "exp_avg_scale", "exp_avg_sq_scale"};
// Whether a run keeps kQ8Blobs[k]: Adam's four arrays, or Lion's one moment's codes and scales (k = 0, 2).
inline bool q8_blob_kept(int k, bool two_states) { return two_states || k % 2 == 0; }

// A piece: elements [begin, begin + n) of one parameter, the unit the overlap schedule copies, steps and
// sends (OffloadOptions::tile elements). Gradient statistics are kept per piece and summed in piece order
// by every schedule, so all of them reach the same decision.
struct Piece {
  std::size_t param, begin, n;
};

// The state of one piece, where a tier keeps it in RAM: the fp32 master and the moments in
// OffloadOptions::state_dtype.
struct PieceState {
  float* p;
  void* m;
  void* v;                // null with one state array
  void* vmax = nullptr;   // amsgrad only
  // State dtype i8: the piece's block scales (moment_blocks(n) each; a piece starts on a block), and where
  // they lie in the tier's scale arrays.
  float* m_scale = nullptr;
  float* v_scale = nullptr;
  std::size_t scale_index = 0;
};

class StateTier {
 public:
  virtual ~StateTier() = default;
  // The state starts as the weights the optimizer was created with (in staging, or in place on the device).
  virtual Status initialize() = 0;
  // One Adam step (a multi-tensor step per param group) over the pieces `which`, with the gradients of
  // staging set `set`. A tier that does not hold pieces in RAM steps every piece at once: `which` must then
  // be all of them, and `aside` false. `aside` (tier ram, after allocate_second_set(): the overlap schedule's
  // speculative steps) reads each piece's current state set and writes the other one, with its weights
  // (Impl::weights_aside, master_aside): the current set stays as it was until Impl::keep_aside() makes the
  // other one current, so a speculation that was wrong has nothing to put back.
  virtual Status step(const std::vector<std::size_t>& which, float grad_scale, int set,
                      const std::vector<ParamGroup>& hyper, bool aside) = 0;
  // [offset, offset + count) of the flattened p, m, v and (amsgrad) vmax, wherever they live; a null array is
  // skipped, and the caller passes none the rule does not keep.
  virtual Status read(std::size_t offset, std::size_t count, float* p, float* m, float* v, float* vmax) = 0;
  virtual Status write(std::size_t offset, std::size_t count, const float* p, const float* m, const float* v,
                       const float* vmax) = 0;
  // Replaces the whole state with the checkpoint's arrays ("master" and the state blobs, Impl::state_blob), now
  // at `step`.
  virtual Status load(const CheckpointReader& reader, const std::string& path, std::int64_t step) = 0;
  // Makes the state as durable as the tier can (tier nvme: fdatasync and tile table); save() calls it.
  virtual Status flush() { return Status::success(); }
  // Tier ram: a piece's state in RAM, which the overlap schedule steps one piece at a time, aside.
  virtual bool in_ram() const = 0;
  // A piece's current state (Impl::set_of), and the other set's (the one a step aside writes).
  virtual PieceState piece(const Piece&) { return {nullptr, nullptr, nullptr}; }
  virtual PieceState piece_aside(const Piece&) { return {nullptr, nullptr, nullptr}; }
  // Tier ram: the second state set, which steps aside write (the overlap schedule's speculation).
  virtual Status allocate_second_set() { return Status(StatusCode::unsupported, "this tier keeps one state set"); }
  // Tier ram: array `which` (0 p, 1 m, 2 v) as one contiguous fp32 array, or null (in place, p is not;
  // bf16 moments are not fp32; a parameter's current set is the second).
  virtual const float* flat(int) const { return nullptr; }
  // Tier ram, fp32 state: parameter i's state array `which` (1 m, 2 v, 3 vmax) in its current set; null
  // otherwise.
  virtual float* moments(std::size_t /*i*/, int /*which*/) { return nullptr; }
  // State dtype i8: the codes and scales as they are kept, added to a checkpoint so that it holds them exactly
  // (their fp32 values are written too, for readers that convert). Every tier writes the same blobs:
  // kQ8Blobs, the codes in flat order and each parameter's block scales in parameter order.
  virtual Status save_q8(CheckpointWriter&) { return Status::success(); }

  // The master weights of f32 parameter i, where the device's copy is sent from: tier ram's own master;
  // tier nvme's device-copyable copy of it, which each step writes (the master itself is in the store).
  virtual float* master(std::size_t) { return nullptr; }
  // Tier ram: where a step aside writes parameter i's master (in place, an f32 parameter's too: its current
  // master is the device's weights, which Impl::keep_aside() then sets).
  virtual float* master_aside(std::size_t) { return nullptr; }
  // Streamed (tier nvme): the 16-bit weights of the parameters marked in `which` (every one: null) rounded
  // from the masters in the store and sent (Impl::send_weights16): after a load, a write_state, or a send
  // that failed.
  virtual Status resend_weights(const std::vector<char>* /*which*/) {
    return Status(StatusCode::unsupported, "this tier keeps its weights in staging");
  }
  // Streamed: the 16-bit weights as a checkpoint's "weights16" blob holds them (parameter order, f32
  // parameters taking no bytes), bytes [offset, offset + n) into `out`, from the masters.
  virtual Status read_weights16(std::size_t /*offset*/, std::size_t /*n*/, void* /*out*/) {
    return Status(StatusCode::unsupported, "this tier keeps its weights in staging");
  }

  // Tier nvme's speculation (the overlap schedule; tier ram undoes pieces instead): one call steps every
  // parameter with a gradient of staging set 0, each tile once ready(i) has said, for each parameter i in it,
  // whether its gradient is down (true: step it; false: it has none this iteration) — or failed, which stops
  // the call. Parameters marked in `left_out` are not stepped and not asked about (their tiles, where no
  // other parameter shares them, are not read). `arrival` gives each parameter's place in the order the
  // last iteration reported gradients (empty: not known): tiles are stepped in the order their gradients are
  // then expected in, else last parameters first. The new state and weights are kept beside the old until
  // commit_speculation(); discard_speculation() drops them and puts back the 16-bit weights the call wrote
  // into the staging.
  using ParamReady = std::function<Result<bool>(std::size_t param)>;
  virtual bool speculates() const { return false; }
  virtual Status speculate(float, const std::vector<ParamGroup>&, const std::vector<char>& /*left_out*/,
                           const std::vector<std::size_t>& /*arrival*/, const ParamReady&) {
    return Status(StatusCode::unsupported, "this tier does not speculate");
  }
  virtual Status commit_speculation() { return Status::success(); }
  virtual Status discard_speculation() { return Status::success(); }
  // Parameters the last speculate() stepped (ready(i) said true): the step of every one of them is in it.
  virtual const std::vector<char>& speculated_params() const {
    static const std::vector<char> kNone;
    return kNone;
  }
};

// New 16-bit (or f32) weights of tiered parameters grouped per parameter tier and block, so that each tier
// writes them in one write_blocks() call: the NVMe home keeps a block's writes in flight together and the next
// block's behind them.
class TierWrites {
 public:
  void add(const ParamSpec& p, std::size_t param, const void* src);
  // Every tier's blocks written; `written(param, ok)` told for each parameter added. The first failure.
  Status write(const std::function<void(std::size_t, bool)>& written = nullptr);

 private:
  struct Tier {
    ParamTier* tier;
    std::vector<ParamBlockWrite> writes;
    std::unordered_map<std::size_t, std::size_t> block_at;  // block -> its entry in `writes`
    std::vector<std::size_t> params;
  };
  std::vector<Tier> tiers_;
};

class StepSchedule {
 public:
  virtual ~StepSchedule() = default;  // joins any work of the schedule still running
  virtual Status grad_ready(std::size_t param) = 0;
  virtual Status step() = 0;
  virtual Status wait() { return Status::success(); }  // work in flight (the delayed background step)
  // The staging set this iteration's gradients go to (delayed alternates two).
  virtual int current_set() const { return 0; }
  // Every gradient of this iteration down with its statistics complete; returns the staging set they are
  // in. step() then takes them no more, unless retake() is called.
  virtual Result<int> take_grads() = 0;
  // The gradients changed after they were taken or reported: step() takes them all again (and undoes what
  // was stepped speculatively with the old ones).
  virtual void retake() = 0;
  // Undoes what was stepped speculatively this iteration (overlap); step() steps it again.
  virtual Status discard_speculative_steps() { return Status::success(); }
  // Waits for the speculative steps started so far (overlap, tier ram): they read which parameters are
  // absent and which gradients were summed, and set_grads_absent() or grads_changed() is about to change it.
  virtual void wait_for_speculative_steps() {}
  // OffloadOptimizer::abandon_iteration(): forgets this iteration's reports and puts back what was stepped or
  // sent during it, without learning from it (the reports' order, the parameters without a gradient).
  virtual Status abandon() = 0;
};

struct OffloadOptimizer::Impl {
  Impl(Device& device, std::vector<ParamGroup> groups, std::vector<ParamSpec> params, const OffloadOptions& options,
       CpuAdam adam);
  ~Impl();

  // Serialises the public calls (offload.h: one call at a time per optimizer, whatever thread makes it).
  // Recursive: a call may make another (write_state waits). The schedules' own threads never take it.
  mutable std::recursive_mutex calls;

  Device& device;
  OffloadOptions options;
  std::vector<ParamGroup> groups;
  std::vector<ParamSpec> params;
  CpuAdam adam;
  // The rule every group runs (zoe/optimizers.h) and its state arrays beside the master: m, (Adam) v and
  // (amsgrad) vmax, v's running maximum. PieceState::v and ::vmax, the tiers' arrays of them and their
  // checkpoint blobs exist only where the rule keeps them.
  Rule rule = Rule::adam;
  std::size_t state_count = 2;
  std::vector<std::string> state_names;  // torch's keys of arrays 1..state_count
  OptimizerHyper first_hyper;            // group 0's at creation: the rule and amsgrad every group keeps
  // Every group's hyper-parameters as the engine runs them (valid, first_hyper's rule and amsgrad): step()
  // and save() refuse what group_hyper() changed otherwise, before anything moves.
  Status check_groups() const;
  bool two_states() const { return state_count > 1; }
  // The checkpoint blobs of array k (0 the master, then the states by name).
  std::string state_blob(int k) const { return k == 0 ? "master" : state_names.at(static_cast<std::size_t>(k) - 1); }
  std::size_t moment_bytes() const { return dtype_size(options.state_dtype); }  // per element of m or v
  LossScaler scaler;
  float visible_scale = 1.0f;  // the scale the trainer multiplies this iteration's loss by
  std::atomic<std::int64_t> step_count{0};
  // Per parameter: steps applied to it (torch's state[p]["step"]; its bias correction), and, per staging
  // set, whether its gradient is absent this iteration (set_grads_absent): such a parameter is not stepped,
  // not copied down and not counted in the decision. Read by the delayed schedule's background step for
  // the set it steps, while the trainer marks the other set's.
  std::vector<std::int64_t> param_steps;
  std::vector<char> absent[2];
  bool is_absent(std::size_t i, int set) const { return !absent[set].empty() && absent[set][i] != 0; }
  std::int64_t bias_step(std::size_t i) const { return param_steps[i] + 1; }
  std::atomic<bool> last_skipped{false};
  std::int64_t step_calls = 0;
  StepStats stats_;
  // The copies' byte counts: the trainer's thread and the schedules' workers add to them at once.
  static void count_bytes(std::uint64_t& stat, std::size_t bytes) {
    std::atomic_ref(stat).fetch_add(bytes, std::memory_order_relaxed);
  }

  // ZeRO partitioning (partition.cpp): this optimizer's `params` are this rank's pieces of the trainer's
  // parameters. Each dtype's parameters are flattened into one vector padded to world x shard elements; the
  // pieces' weights live in its flat weights and their gradients arrive in shard_grads (or, when they come
  // averaged in flat buffers, in the flat gradients themselves).
  struct Partition {
    struct Flat {
      DType dtype = DType::bf16;
      std::vector<std::size_t> members;  // indices into `user`, in flat order
      std::vector<std::size_t> offsets;  // their first elements in the flat vector
      std::size_t shard = 0;             // elements per rank
      void* grads = nullptr;             // the flat vectors: the trainer's (flat_buffers) or ours
      void* weights = nullptr;
      void* shard_grads = nullptr;       // the reduction's output, ours; unused when the gradients come averaged
    };
    Collectives* comm = nullptr;
    PartitionOptions options;
    std::vector<ParamSpec> user;  // the trainer's parameters
    std::vector<Flat> flats;
    std::vector<Piece> origin;    // where each of this optimizer's params (pieces) lies in `user`
    void release(Device& device);  // frees what is ours
  };
  std::unique_ptr<Partition> partition;
  bool grads_reduced = false;  // grad_norm() reduced this iteration's gradients already
  Status partition_reduce_grads();    // before the step: every parameter's gradient, summed into the shard
  Status partition_gather_weights();  // after it: the updated shards back into every parameter

  std::vector<Piece> pieces;
  std::vector<std::size_t> first_piece;  // pieces of parameter i: [first_piece[i], first_piece[i + 1])

  // Element offsets of each parameter in the flat fp32 arrays, and byte offsets in the staging.
  std::vector<std::size_t> offsets, grad_offsets, weight_offsets;
  std::unique_ptr<StateTier> tier;
  // Destroyed before the tier and the staging it uses (see ~Impl).
  std::unique_ptr<StepSchedule> schedule;
  // Device-copyable staging. Gradients: one set, two for delayed (step t reads one while iteration t+1's
  // come down into the other). Weights: the 16-bit copy the device holds.
  void* grad_staging[2] = {nullptr, nullptr};
  std::vector<GradStats> stats[2];  // per piece
  void* weight_staging = nullptr;

  // In place (a device whose memory is host memory; tier ram, not delayed, or tier nvme, sync, 16-bit weights
  // only): gradients are read where the device keeps them, 16-bit weights written there, and (tier ram) an
  // f32 parameter's device weights are its master. Tier nvme with an f32 parameter is staged: its master
  // lives in the store, and the copy the step writes (master_of) is sent as a 16-bit parameter's weights are.
  bool in_place = false;
  // Streamed (tier nvme, sync, no micro-batch sums; docs/architecture.md, "Host memory that does not grow
  // with the model"): no staging the size of the model. The step runs window by window through the store
  // (step_windows.cpp): each window's gradients come down into a window buffer (or are read in place where
  // the device's memory is host memory: grads_in_place), its 16-bit weights are written into another and
  // sent to the device or the parameter tier before the next window. weights_of() has no staging then.
  bool streamed = false;
  bool grads_in_place = false;  // in_place, or streamed on a device whose memory is host memory
  // Gradient statistics cost a pass over the gradients; in place, they are taken only when clipping, loss
  // scaling or the NaN/Inf refusal needs them.
  bool need_stats = true;
  // In place, the norm only when clipping or loss scaling uses it; the refusal alone needs just the count.
  bool need_norm = true;
  // An f32 parameter's master as the device receives it: in place, the device's weights; else the tier's
  // (tier ram: the master it steps; tier nvme: the copy its step writes, the master living in the store).
  float* master_of(std::size_t i) {
    if (in_place && params[i].dtype == DType::f32) return static_cast<float*>(params[i].device_weights);
    return tier->master(i);
  }
  void* grad_of(std::size_t i, int set) {
    if (grads_in_place) return const_cast<void*>(params[i].device_grads);
    if (streamed) return nullptr;  // the window's buffer holds it while the step reads it
    return static_cast<unsigned char*>(grad_staging[set]) + grad_offsets[i];
  }
  // Gradient accumulation (accumulation.cpp; OffloadOptions::gradient_accumulation_steps): per staging set,
  // the fp32 sums of the micro-batches and how many each parameter's holds (0: the step reads the device's
  // gradient as without accumulation); reports per parameter in this iteration.
  AlignedBuffer accum[2];
  std::vector<int> added[2];
  std::vector<int> reports;
  // Staged devices: the adds of micro-batches before the last run here while backward goes on; a parameter
  // with one queued (add_queued) waits for it before its staging is written again.
  std::unique_ptr<WorkQueue> add_worker;
  std::vector<char> add_queued;
  Status add_status;  // the first failure of a queued add, read after drain_adds()
  Status drain_adds();
  bool accumulates() const { return options.gradient_accumulation_steps > 1; }
  bool in_accum(std::size_t i, int set) const { return !added[set].empty() && added[set][i] > 0; }
  Status allocate_accumulation();
  // A micro-batch's gradient of parameter i reported final: added into accum[set]; the device's buffer is
  // zeroed (not the last) or receives the rounded sum (the last).
  Status add_micro_batch(std::size_t i, int set, bool last);
  Status queue_micro_batch(std::size_t i, int set);  // staged, not the last: copied, zeroed, added on add_worker
  Result<EventId> copy_down(std::size_t i, int set);  // parameter i's gradient into staging, once produced
  // At step(): the last micro-batch of every parameter reported fewer than k times is added.
  Status finish_accumulation(int set);
  // The trainer changed the device's gradients: they, not the sums, are this step's.
  void drop_accumulation(int set);
  void reset_accumulation(int set);
  // The gradient the step reads for parameter i: its fp32 sum, or the staged / in-place copy.
  const void* step_grad(std::size_t i, int set, DType* dtype) {
    if (in_accum(i, set)) {
      *dtype = DType::f32;
      return accum[set].as<float>() + offsets[i];
    }
    *dtype = params[i].dtype;
    return grad_of(i, set);
  }
  // Parameter offload on a device with its own memory (docs/architecture.md, "Parameters off the device"): a tiered
  // parameter's gradient comes down when it is reported, in every schedule, and the compute stream waits for
  // that copy, so the trainer may give the gradient's device memory to the next block at once. grad_down[i]:
  // this iteration's gradient of parameter i is on the host; step() does not read the device's buffer again.
  std::vector<char> grad_down;
  bool grad_leaves_when_reported(std::size_t i) const {
    return spill != nullptr || (params[i].tier != nullptr && !device.host_memory() && !options.grads_stay_on_device);
  }
  // OffloadOptions::spill_grads: where each gradient goes when it leaves (enqueue_d2h), read back by the
  // streamed step's windows.
  std::unique_ptr<GradSpill> spill;
  // After parameter i's gradient was enqueued down (enqueue_d2h): the compute stream waits for the copy.
  Status grad_left_device(std::size_t i);
  // Schedules that otherwise take gradients at step() (sync, the delayed warm-up): parameter i's into `set` now.
  Status take_reported_grad(std::size_t i, int set);
  void* weights_of(std::size_t i) {
    if (in_place) return params[i].device_weights;
    if (streamed) return nullptr;  // in a window only while its step runs (step_windows.cpp)
    return static_cast<unsigned char*>(set_of(i) == 0 ? weight_staging : weight_aside) + weight_offsets[i];
  }
  // Two state sets (tier ram with the overlap schedule: allocate_second_set()). current_set[i]: which one
  // holds parameter i's state in the tier and, staged, its 16-bit weights in weight_staging (0) or
  // weight_aside (1). A speculative step writes the other set (weights_aside, master_aside); keep_aside(i)
  // makes it current, in place by copying into the device's weights, which stay where the model has them.
  std::vector<char> current_set;
  void* weight_aside = nullptr;
  int set_of(std::size_t i) const { return current_set.empty() ? 0 : current_set[i]; }
  Status allocate_second_set();
  void* weights_aside(std::size_t i) {
    const bool second = in_place || set_of(i) == 0;  // in place, weight_aside is the scratch
    return static_cast<unsigned char*>(second ? weight_aside : weight_staging) + weight_offsets[i];
  }
  float* master_aside(std::size_t i) { return tier->master_aside(i); }
  void keep_aside(std::size_t i);
  // Streamed: 16-bit parameters whose new weights did not reach their place (a failed tier write): sent
  // again from the masters by send_all_weights().
  std::vector<char> unsent;
  // Elements [begin, begin + n) of parameter i's device weights set to follow `master`: a 16-bit parameter's
  // rounded from it; an f32 parameter's are the master itself, copied where the tier keeps the device's copy
  // apart from its state (tier nvme: master_of(i)), while in tier ram they are the state the tier just wrote.
  void weights_follow_master(std::size_t i, std::size_t begin, const float* master, std::size_t n) {
    if (params[i].dtype == DType::f32) {
      float* w = master_of(i) + begin;
      if (w != master && n > 0) std::memcpy(w, master, n * 4);
      return;
    }
    auto* w = static_cast<std::uint16_t*>(weights_of(i)) + begin;
    const bool f16 = params[i].dtype == DType::f16;
    for (std::size_t j = 0; j < n; ++j) w[j] = f16 ? float_to_f16(master[j]) : float_to_bf16(master[j]);
  }

  Status allocate();
  Status load_initial_weights();
  Status fill_initial_state();  // Adagrad's initial_accumulator_value
  // Called for each piece once its gradient copy is enqueued, with an event recorded after it.
  using PieceDown = std::function<Status(std::size_t piece, EventId copied)>;
  // Gradients of parameter i down into staging `set`, with their statistics; `on_piece` (overlap) steps
  // each piece speculatively once it is down.
  Status enqueue_d2h(std::size_t i, int set, const PieceDown& on_piece = nullptr);
  // In place: once the compute stream has produced them, the statistics of every gradient, taken on the
  // engine's threads (no copy to enqueue).
  Status grad_stats_in_place(int set);
  Status enqueue_h2d(std::size_t i);
  // Piece k's weights of its current set, or (aside) of the other one, just written by a step aside.
  Status enqueue_h2d(const Piece& k, bool aside = false);
  // The compute stream (the next forward) waits for every weight sent so far; returns the event after which
  // the weight staging may be rewritten.
  Result<EventId> weights_sent();
  // weights_sent(); on a device with memory of its own the host waits for that event only when the staging
  // (or an fp32 master, the source of its parameter's copy) is next written: staging_writable(), called by
  // the steps once this iteration's gradients are down — the device sent the weights before the forward and
  // backward that produced them, so the wait blocks nothing. wait(), load() and write_state() wait for
  // everything anyway. The CPU as the device (host memory) waits at once: the trainer reads the weights
  // on the host when step() returns.
  Status finish_h2d();
  Status staging_writable();
  std::mutex weights_in_flight_mutex;  // the overlap worker and the trainer's thread
  std::optional<EventId> weights_in_flight;
  // The whole step over every parameter, timed into stats_.adam_s by the tier.
  Status step_all(float grad_scale, int set, const std::vector<ParamGroup>& hyper);
  struct Decision {
    bool overflow;
    double grad_norm;
    float grad_scale;
    Status error;  // partitioned: the ranks could not agree (the collective failed); nothing was decided
    bool refused = false;  // a non-finite gradient without loss scaling, and refuse_non_finite: no step
  };
  // The error a refused step returns: which parameters hold NaN/Inf gradients (from the statistics of `set`).
  Status non_finite_error(int set) const;
  // max_grad_norm: the clipping in force when the step was called (the delayed schedule decides later, in
  // the background, while the trainer may already have set the next step's).
  Decision decide(int set, float scale_used, float max_grad_norm) const;
  // The step of staging set `set` was decided (and, without overflow, applied): counts it.
  void record_outcome(const Decision& d, int set);
  // Parameter offload (ParamSpec::tier): the updated weights of a tiered parameter are written to its tier
  // once the step is decided (overlap does not send them speculatively). A write that fails leaves the step
  // applied and its weights pending: the next step() call writes them all and does nothing else, so a
  // retried step gives the uninterrupted result.
  bool weights_pending = false;
  Decision pending_decision{};
  int pending_set = 0;
  Status write_tier_weights();
  // Every parameter's updated weights to the device (enqueued, then waited for) and to the parameter tiers.
  Status send_all_weights();
  Status weights_not_sent(const Decision& d, int set, const Status& cause);
  Status send_pending_weights();
};

using Impl = OffloadOptimizer::Impl;

// The checks create() makes before allocating anything (optimizer.cpp).
Status check_inputs(const std::vector<ParamGroup>& groups, const std::vector<ParamSpec>& params,
                    const OffloadOptions& options);

Result<std::unique_ptr<StateTier>> make_ram_tier(Impl& m);
// Tier nvme: a swap store named `name` under options.nvme.paths, replacing one an earlier run left there.
Result<std::unique_ptr<StateTier>> make_nvme_tier(Impl& m, const char* name);

// sync (schedule_sync.cpp) also serves the other schedules' fallbacks: the delayed warm-up, overlap on tier
// nvme, and partitioned optimizers.
Status sync_step(Impl& m);
Status take_all_grads(Impl& m);    // every gradient into staging set 0 with its statistics, and waits for them
Status finish_sync_step(Impl& m);  // every gradient is down (its taker waited): decide, step, send the weights up
// The schedule of m.options.schedule, after m.allocate().
Result<std::unique_ptr<StepSchedule>> make_schedule(Impl& m);
std::unique_ptr<StepSchedule> make_sync_schedule(Impl& m);
Result<std::unique_ptr<StepSchedule>> make_overlap_schedule(Impl& m);
std::unique_ptr<StepSchedule> make_delayed_schedule(Impl& m);

}  // namespace zoe
