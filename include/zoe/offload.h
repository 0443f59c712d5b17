// OffloadOptimizer: the offloaded training step. fp32 master weights and Adam moments live on the host
// (pinned RAM, or NVMe swap files); the device keeps 16-bit weights and gradients. Schedules (docs/architecture.md):
// sync, overlap (gradients stream in during backward; exact, by speculation with undo/redo when clipping
// or an fp16 overflow changes the step), delayed (ZeRO-Offload's delayed parameter update).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "zoe/adam.h"
#include "zoe/device.h"
#include "zoe/dtype.h"
#include "zoe/io_fault.h"
#include "zoe/optimizers.h"
#include "zoe/status.h"

namespace zoe {

class Collectives;  // zoe/partition.h
class ParamTier;    // zoe/param_tier.h

enum class Tier { ram, nvme };
enum class Schedule { sync, overlap, delayed };

// Tier nvme: what a crash (of the process or the machine) may cost the swap files, against what each step
// pays for it. Both keep, within a run, every guarantee of step(): a failed step retried gives the
// uninterrupted result, and every tile read is checked against its CRC-32C.
//  - step: each step's writes are fdatasync'ed, and the tile table naming them persisted, in the background
//    after step() returns — beside the next forward/backward and the next step's reads; the next step's
//    first write waits for it. The table on disk names the last durable step: after a crash the swap files
//    hold step t or t-1 whole, never a mix. Costs an fdatasync and a table write per step, off the
//    critical path unless the next step comes sooner than they finish.
//  - checkpoint: no fdatasync per step; the swap files are made durable at save() (and when the optimizer
//    is destroyed). After a crash between saves they may be unusable — their checksums refuse them, they are
//    never used wrong: resume from the last save(), which is how a run resumes anyway (a new optimizer
//    replaces the swap files it finds).
enum class Durability { step, checkpoint };

std::string_view tier_name(Tier tier);
std::string_view schedule_name(Schedule schedule);
std::string_view durability_name(Durability durability);
// The names back to values; anything else is invalid_argument naming the choices.
Result<Tier> parse_tier(std::string_view name);
Result<Schedule> parse_schedule(std::string_view name);
Result<Durability> parse_durability(std::string_view name);
// OffloadOptions::state_dtype by the names users give it: "fp32", "bf16", "int8" (DType f32, bf16, i8).
std::string_view state_dtype_name(DType state);
Result<DType> parse_state_dtype(std::string_view name);

// fp16 loss scaling, with the knobs of DeepSpeed's fp16 section and torch's GradScaler. Dynamic: start at
// initial_scale; an overflow skips the step and, once `hysteresis` overflows have been seen, multiplies the
// scale by backoff_factor (never below min_scale); growth_interval steps without overflow multiply it by
// growth_factor.
struct LossScaleOptions {
  bool enabled = false;          // fp16 training; bf16 and fp32 need no scaling
  bool dynamic = true;           // false: static_scale forever (an overflow still skips the step)
  float static_scale = 1.0f;
  float initial_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int growth_interval = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;  // refill the hysteresis budget after each step without overflow
  float min_scale = 1.0f;
};

// The dynamic loss scaler's state, saved with the optimizer state: the scale, the clean steps since it last
// changed, and the overflows left before it backs off (hysteresis).
struct LossScaleState {
  float scale = 1.0f;
  std::int64_t clean_steps = 0;
  std::int32_t hysteresis_left = 0;
};

struct NvmeOptions {
  std::vector<std::string> paths;      // DeepSpeed: offload_optimizer.nvme_path (one or a list)
  int buffer_count = 4;                // DeepSpeed: offload_optimizer.buffer_count
  std::size_t block_size = 1 << 20;    // DeepSpeed: aio.block_size
  int queue_depth = 8;                 // DeepSpeed: aio.queue_depth
  std::size_t alignment = 0;           // O_DIRECT block: 0 = 4096, or more where a filesystem asks for more
  Durability durability = Durability::step;  // zoe config: zoe.nvme_durability
  // A state that fits in buffer_count tiles stays in those buffers between steps (SwapOptions::keep_resident
  // in zoe/swap.h): a step reads nothing and its writes finish during the next forward and backward.
  bool keep_resident = true;           // zoe config: zoe.nvme_keep_resident
  IoFaultHook fault_hook;              // tests only: the swap store's I/O sites (zoe/io_fault.h)
};

// How a partitioned optimizer (create() with a Collectives of world > 1) meets the trainer's buffers.
struct PartitionOptions {
  // The parameters of each dtype lie back to back, in the order given, in one weight buffer and one
  // gradient buffer per dtype, each padded to a multiple of the world size (world x ceil(elements / world)
  // elements; the padding's values are never used): gradients are reduced and weights gathered right
  // there, without the two flat copies of the model the optimizer otherwise keeps on the device. A
  // parameter that does not follow the one before it is refused at create().
  bool flat_buffers = false;
  // The gradients arrive averaged over the ranks already (DistributedDataParallel's backward did it): no
  // reduction, each rank steps its shard of them. The global norm and the NaN/Inf check still span every
  // rank.
  bool grads_averaged = false;
};

struct OffloadOptions {
  Tier tier = Tier::ram;
  NvmeOptions nvme;
  Schedule schedule = Schedule::sync;
  int delayed_warmup_steps = 10;       // sync steps before the delayed schedule starts
  float max_grad_norm = 0.0f;          // 0: no clipping. DeepSpeed: gradient_clipping
  LossScaleOptions loss_scale;
  // A NaN/Inf gradient without fp16 loss scaling (where it is an overflow, skipped): true refuses the step —
  // step() returns an error naming the parameter and no state changes; false lets it propagate into the
  // state, as torch.optim does. Refusing costs a pass over the gradients (their statistics: on the device
  // with a GPU; in place, on the CPU Adam engine's threads at memory speed).
  bool refuse_non_finite = true;
  // Gradient accumulation: micro-batches per step (DeepSpeed: gradient_accumulation_steps). With k > 1 the
  // trainer calls grad_ready(i) once per micro-batch for every parameter (all schedules); the first k-1 add
  // that micro-batch's gradient into an fp32 accumulator on the host and zero the device's buffer for the
  // next one; the k-th adds the last and writes the sum, rounded to the parameter's dtype, back into the
  // device's buffer, so that the trainer sees the whole step's gradient there. step() steps the fp32 sum —
  // or, after grads_changed(), the device's buffer as the trainer left it. A parameter reported fewer
  // than k times has its last micro-batch taken at step(). overlap steps speculatively only on the k-th
  // report. Costs 4 bytes per parameter of host RAM (8 with the delayed schedule).
  int gradient_accumulation_steps = 1;
  PartitionOptions partition;  // with a Collectives of world > 1 only
  // How the Adam moments m and v are stored (zoe config: zoe.state_dtype): f32; bf16 — 4 bytes less per
  // parameter for each, rounded to nearest even after every fp32 update; or i8 — one byte each and an fp32
  // scale per 2048 elements (AdamTensor::state_dtype has the codes). The master weights stay fp32. Both
  // tiers hold every dtype (tier nvme's swap slots hold the compact form; with i8 each parameter starts a
  // block of the swap range). read_state() and checkpoints give fp32 values (an i8 checkpoint also holds the
  // codes, so the run resumes exactly, on either tier), and a checkpoint of any dtype loads into any (fp32
  // moments are rounded or encoded).
  DType state_dtype = DType::f32;
  std::size_t tile = 1 << 20;          // elements per unit of pipelined work. DeepSpeed's sub_group_size is larger
  // Tier nvme with the sync schedule (no gradient accumulation) steps the store window by window, holding one
  // window of 16-bit weights (and, on a device with memory of its own, of gradients) on the host instead of a
  // staging the size of the model: elements per window, 0 for 32Mi. A window holds at least the largest
  // parameter and two tiles of the store.
  std::size_t step_window = 0;
  // Parameters in a parameter tier on a device with memory of its own: their gradients stay where the
  // trainer keeps them until step() (FSDP2's sharded gradients) instead of leaving at grad_ready() for one
  // device window shared by all, so tier nvme's sync step streams them from there too.
  bool grads_stay_on_device = false;
  // Tier nvme's streamed step only (sync, no micro-batch sums, not partitioned): every gradient goes to a
  // file beside the swap store (on the first NVMe path, 2 bytes per 16-bit element) as soon as it is
  // reported (grad_ready(), spill_grad()) or, unreported, at step(); the step reads it back window by window.
  // Neither the device nor host RAM holds the iteration's gradients: the trainer may free a gradient once it
  // is reported. Its statistics (norm, NaN/Inf) are taken as it goes, so clipping and the refusal still hold;
  // grads_changed() is refused once one has gone (change gradients before reporting them).
  bool spill_grads = false;
  CpuAdamOptions cpu;
};

// OffloadOptions field by field, by the one flat name each has outside C++ (the Python binding's
// EngineOptions, the "options" of a parsed DeepSpeed config): the binding and the config's dictionary are
// loops over this table, so a new option is added to the struct above and to the table
// (src/offload/options.cpp), nowhere else. Values travel as one of five kinds; a choice (tier, schedule, ...)
// travels as its name.
using OptionValue = std::variant<bool, std::int64_t, double, std::string, std::vector<std::string>>;
struct OptionField {
  std::string_view name;
  OptionValue (*get)(const OffloadOptions&);
  // A value of get()'s kind. One the field cannot hold (out of range, an unknown name, a scale that is not
  // finite and > 0) is invalid_argument starting with the field's name, and the options stay as they were.
  Status set(OffloadOptions& options, const OptionValue& value) const { return assign(options, value, name); }
  Status (*assign)(OffloadOptions&, const OptionValue&, std::string_view name);
};
std::span<const OptionField> option_fields();

// A param group: parameters sharing hyper-parameters (as in torch.optim).
// Its rule and hyper-parameters (zoe/optimizers.h): every group of one optimizer runs the same rule, which
// fixes the state arrays each parameter keeps.
struct ParamGroup {
  OptimizerHyper hyper;
};

// One parameter as the device holds it.
struct ParamSpec {
  std::size_t n = 0;
  DType dtype = DType::bf16;       // of the device weights and gradients: f16, bf16 or f32
  void* device_weights = nullptr;  // updated by the optimizer (H2D) after each step
  const void* device_grads = nullptr;
  // Parameter offload: the 16-bit weights live in entry `tier_entry` of block `tier_block` of a parameter
  // tier (zoe/param_tier.h; not owned, it must outlive the optimizer) instead of at device_weights (null
  // then). They are read from it at create() and each step writes the updated weights into it, not to the
  // device — delayed as it sends them to the device, once the parameter's gradient of the next iteration is
  // final, so a forward always reads whole blocks of one step. Not partitioned.
  // On a device with its own memory, its gradient leaves the device when grad_ready() reports it, in every
  // schedule (sync included: report it as its block's backward ends), and the compute stream waits for that
  // copy: the trainer may hand device_grads' memory to the next block at once (device_grads may then alias
  // another tiered parameter's). With micro-batches the reports are summed in fp32 on the host and nothing
  // is written back to device_grads. Unreported, it is taken at step() from device_grads, as any other.
  ParamTier* tier = nullptr;
  std::size_t tier_block = 0, tier_entry = 0;
  int group = 0;
  // Recorded in checkpoints, for `zoe export` (optional: unnamed parameters are exported as param.<i>, and
  // without a shape as one dimension of n).
  std::string name;
  std::vector<std::int64_t> shape;
};

struct StepStats {
  std::int64_t steps = 0;          // optimizer steps applied
  std::int64_t skipped = 0;        // steps skipped for an fp16 overflow
  std::int64_t redone = 0;         // overlap: speculative steps undone and redone (clipping or overflow)
  double last_grad_norm = 0;       // of the unscaled gradients, before clipping (NaN if any is not finite)
  double adam_s = 0;               // CPU Adam, summed (seconds); tier nvme: the whole streamed step
  double step_call_s = 0;          // time the trainer spent inside step(), summed
  std::uint64_t d2h_bytes = 0, h2d_bytes = 0;
  // tier nvme: bytes moved to and from the swap files, and the seconds reads / writes were in flight.
  std::uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;
  double nvme_read_s = 0, nvme_write_s = 0;
};

// Threads: the calls of one optimizer are serialised (a lock per optimizer), so calls made from several
// threads never interleave — a save() on another thread than step() records one whole step, before or after
// it. Order between threads is theirs to choose: a step() and a save() racing give either order. Two
// exceptions return references, which the lock cannot cover: group_hyper() and stats() — use them from the
// thread that steps, between calls.
class OffloadOptimizer {
 public:
  // The master weights start as the device weights converted to fp32 (read once through the device).
  // Tier nvme keeps p, m and v in a swap store named "zoe-optimizer" under options.nvme.paths (one left by
  // an earlier run there is replaced: save() is how state outlives a run); an f32 parameter's master is
  // there too, and each step copies it into a pinned copy that goes to the device.
  static Result<OffloadOptimizer> create(Device& device, std::vector<ParamGroup> groups,
                                         std::vector<ParamSpec> params, const OffloadOptions& options);
  // ZeRO partitioning over `partition`'s ranks (zoe/partition.h): every rank passes the same parameters and
  // owns the optimizer state of its 1/W of their flattened elements. Gradients are reduce-scattered on the
  // device and averaged (divided by W in the fused grad scale, as DDP and DeepSpeed do); updated weights are
  // all-gathered back into every parameter. Each dtype is flattened on its own (in the order its first
  // parameter comes); options.partition says whether the trainer's buffers are flat already and whether the
  // gradients come averaged. Schedule sync. `partition` must outlive the optimizer. read_state() then
  // indexes this rank's pieces of the parameters, dtype by dtype in flat order. load() is collective: every
  // rank loads its own checkpoint, and the weights are all-gathered.
  static Result<OffloadOptimizer> create(Device& device, std::vector<ParamGroup> groups,
                                         std::vector<ParamSpec> params, const OffloadOptions& options,
                                         Collectives* partition);
  OffloadOptimizer(OffloadOptimizer&&) noexcept;
  OffloadOptimizer& operator=(OffloadOptimizer&&) noexcept;
  ~OffloadOptimizer();

  // The trainer calls this (overlap schedule) once a parameter's gradient is final for this iteration,
  // after enqueueing the work that produces it on the device's compute stream. Other schedules ignore it —
  // unless gradients are accumulated (OffloadOptions::gradient_accumulation_steps), where every schedule
  // takes each micro-batch's gradient when it is reported.
  Status grad_ready(std::size_t param);
  // torch's rule for a parameter whose gradient is None at step(): the coming step leaves it exactly as it
  // is — master, moments, device weights and its own step count — and neither copies its gradient nor
  // counts it in the norm or the NaN/Inf check. Names every such parameter of this iteration, replacing an
  // earlier call's list (an empty list: every parameter has a gradient); a step that succeeds clears it.
  // Partitioned: the pieces of this rank, as read_state() numbers them. Call before step(), after any
  // grad_ready() of theirs: what the overlap schedule stepped of one reported already is put back.
  Status set_grads_absent(const std::vector<std::size_t>& params);
  // Parameter `param`'s gradient is at `grads` from now on (p.n elements of its dtype on the device), in place
  // of ParamSpec::device_grads: a framework that allocates each iteration's gradients (torch after
  // zero_grad(set_to_none=True)) hands them over without a copy. The memory must stay valid while the engine
  // may read it — until the step that takes it has returned — and be replaced (set_grads_absent, or another
  // call) before it is freed. Refused for partitioned optimizers (their gradients are reduced in flat
  // buffers) and for tiered parameters on a device with its own memory (their gradient's place is a window).
  Status set_grad_source(std::size_t param, const void* grads);
  // OffloadOptions::spill_grads: parameter `param`'s gradient, at `grads` (its n elements of its dtype on the
  // device), goes to the spill file now and counts as reported; the memory may be freed once this returns
  // (ParamSpec::device_grads is not read for it). One report per parameter and iteration: a second is
  // refused (the spill does not sum micro-batches). A failed write fails the step until abandon_iteration().
  Status spill_grad(std::size_t param, const void* grads);
  // Ends the iteration: every gradient is final. Applies the step (or, delayed, starts it) and leaves the
  // updated weights on the device — after wait() for the delayed schedule's previous step. Tier nvme: a
  // step that failed on I/O says which state is valid and may be called again once the fault is cleared;
  // it then completes what is missing and gives the result of an uninterrupted run.
  Status step();
  // Waits for all work in flight (the delayed schedule's background step included). Between backward and
  // step(), the overlap schedule's steps taken during backward are undone (step() takes them again): what
  // reads or writes the state then (save, read_state, write_state) sees it as before this iteration's step.
  Status wait();

  // The trainer changed gradients after they were final (it clipped or unscaled them, or edited them in
  // place, between backward and step()): step() takes every gradient again, and the overlap schedule undoes
  // what it stepped speculatively with the old values, so the step is the one sync gives with the changed
  // gradients. Costs the overlap of this step, never its result. Refused, changing nothing, once a tiered
  // parameter's gradient has left the device (ParamSpec::tier).
  Status grads_changed();
  // The overlap schedule's steps of this iteration taken during backward are undone: state and device
  // weights as before them, and step() takes those steps again from the state as it is then. For a trainer
  // that changed the weights the speculative steps started from (the model's weights are the truth between
  // steps): discard, read_state(), write_state() the new master, step(). Other schedules: nothing to undo.
  Status discard_speculative_steps();
  // The trainer gives this iteration up before step() (an exception ended its backward, or it discards the
  // gradients): what it reported and summed, the gradients taken and the parameters named absent are
  // dropped, and what was stepped or sent during it is put back — overlap's speculative steps undone (tier
  // nvme: its speculation dropped), and the weights of the delayed schedule's previous step that went up
  // during it replaced by those its forward used (that step itself stays, and goes up in the next backward).
  // State and device weights are then as before the iteration, which the trainer runs again from its first
  // micro-batch; the result is an uninterrupted run's.
  Status abandon_iteration();
  // The global L2 norm of this iteration's gradients, unscaled (over every rank when partitioned; NaN if any
  // is NaN/Inf), as step() will compute it: the gradients are taken now (copied down, their statistics
  // summed), and step() does not take them again unless grads_changed() is called.
  Result<double> grad_norm();
  // Clipping from the next step on (0: none); torch's clip_grad_norm_ semantics, fused into the step.
  Status set_max_grad_norm(float max_norm);

  // record_names false leaves the parameters' names out (a checkpoint carried inside a framework's own
  // state_dict, which names them itself): the same state then gives the same bytes however it was named.
  Status save(const std::string& path, bool record_names = true);
  Status load(const std::string& path);

  // Hyper-parameters may change between steps (learning-rate schedules); the rule may not (step() refuses).
  OptimizerHyper& group_hyper(std::size_t group);
  float loss_scale() const;
  // The loss scaler's state (what save() records; the delayed schedule's background step updates it: read it
  // after wait()), and its replacement (state taken over from another front-end's checkpoint): refused,
  // changing nothing, unless loss scaling is on, the scale finite and > 0 and the counts >= 0.
  LossScaleState loss_scale_state() const;
  Status set_loss_scale_state(const LossScaleState& state);
  std::int64_t step_count() const;  // steps applied (skipped fp16 overflows not counted)
  // Steps applied to parameter `param` (read_state()'s numbering), as torch's state[p]["step"]: the steps
  // in which it had a gradient (set_grads_absent). Adam's bias correction of that parameter uses it. Beside
  // the delayed schedule's background step: the count before it or after it (exact after wait()).
  std::int64_t param_step_count(std::size_t param) const;
  bool last_step_skipped() const;
  // The step reads the gradients where the trainer's buffers hold them (host memory, no staging copy): a
  // gradient changed after the norm was taken is what the step reads.
  bool reads_grads_in_place() const;
  const StepStats& stats() const;  // exact after wait(); the delayed schedule updates it in the background
  // Elements of each parameter read_state() and write_state() take (partitioned: of each piece).
  std::vector<std::size_t> state_sizes() const;
  // The fp32 master weights / moments of a parameter, of a whole step (it waits first, as wait()).
  // The arrays are the rule's state arrays in order (zoe/optimizers.h): Lion's and Adagrad's one is passed as
  // exp_avg (exp_avg_sq null); max_exp_avg_sq only with amsgrad.
  Status read_state(std::size_t param, float* master, float* exp_avg, float* exp_avg_sq,
                    float* max_exp_avg_sq = nullptr) const;
  // Replaces them (state taken over from another optimizer, or another partitioning); the device weights
  // become the master rounded to their dtype, as after a step. A null array leaves that one as it is.
  // Refused, changing nothing, unless every value is finite and exp_avg_sq, max_exp_avg_sq and sum >= 0.
  // Waits for work in flight.
  // Partitioned: `param` is this rank's piece, as in read_state(); the other ranks' weights are not
  // gathered (step() or load() does that).
  Status write_state(std::size_t param, const float* master, const float* exp_avg, const float* exp_avg_sq,
                     const float* max_exp_avg_sq = nullptr);
  // Tier ram with fp32 state: the address of parameter `param`'s state array `which` (1 exp_avg, Lion's or
  // Adagrad's one; 2 exp_avg_sq; 3 max_exp_avg_sq with amsgrad), p.n floats, for views that read and write the optimizer's own state (as torch's state[p] tensors are),
  // in the parameter's current state set. The overlap schedule's kept step makes the other set current, and
  // load() the first: take the address again after a step() or load() (before them it shows the state
  // before them). Null for any other tier or moment dtype, or a bad argument. Call wait() before reading.
  float* moments_of(std::size_t param, int which);
  // Sets the number of steps applied (Adam's bias correction continues from it), as after load(): of the
  // optimizer and of every parameter.
  Status set_step_count(std::int64_t steps);
  // Sets one parameter's step count (state taken over from torch, where each parameter has its own).
  Status set_param_step_count(std::size_t param, std::int64_t steps);

  struct Impl;  // opaque; defined in src/offload/ (named here so the engine's schedules and tiers can take it)

 private:
  explicit OffloadOptimizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoe
