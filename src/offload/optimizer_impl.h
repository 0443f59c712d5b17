// The state behind OffloadOptimizer, shared by its schedules (optimizer.cpp) and save/load
// (optimizer_io.cpp).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "src/aligned_buffer.h"
#include "src/offload/loss_scaler.h"
#include "src/offload/work_queue.h"
#include "zoe/offload.h"
#include "zoe/partition.h"
#include "zoe/swap.h"

namespace zoe {

struct OffloadOptimizer::Impl {
  Impl(Device& device, std::vector<ParamGroup> groups, std::vector<ParamSpec> params, const OffloadOptions& options,
       CpuAdam adam);
  ~Impl();

  Device& device;
  OffloadOptions options;
  std::vector<ParamGroup> groups;
  std::vector<ParamSpec> params;
  CpuAdam adam;
  LossScaler scaler;
  float visible_scale = 1.0f;  // the scale the trainer multiplies this iteration's loss by
  std::atomic<std::int64_t> step_count{0};
  std::atomic<bool> last_skipped{false};
  std::int64_t step_calls = 0;
  StepStats stats_;

  // ZeRO partitioning: this optimizer's `params` are this rank's pieces of the trainer's parameters, whose
  // weights live in flat_weights and whose gradients arrive in shard_grads (device memory).
  struct Partition {
    Collectives* comm = nullptr;
    std::vector<ParamSpec> user;           // the trainer's parameters
    std::vector<std::size_t> user_offsets;  // their first elements in the flattened vector
    DType dtype = DType::bf16;
    std::size_t shard = 0;                  // elements per rank (the flattened vector padded to world x shard)
    void* flat_grads = nullptr;
    void* flat_weights = nullptr;
    void* shard_grads = nullptr;
  };
  std::unique_ptr<Partition> partition;
  Status partition_reduce_grads();    // before the step: every parameter's gradient, summed into the shard
  Status partition_gather_weights();  // after it: the updated shards back into every parameter

  // A piece: elements [begin, begin + n) of one parameter, the unit the overlap schedule copies, steps and
  // sends (OffloadOptions::tile elements). Gradient statistics are kept per piece and summed in piece order
  // by every schedule, so all of them reach the same decision.
  struct Piece {
    std::size_t param, begin, n;
  };
  std::vector<Piece> pieces;
  std::vector<std::size_t> first_piece;  // pieces of parameter i: [first_piece[i], first_piece[i + 1])

  // Element offsets of each parameter in the flat fp32 arrays, and byte offsets in the staging.
  std::vector<std::size_t> offsets, grad_offsets, weight_offsets;
  AlignedBuffer master, exp_avg, exp_avg_sq;  // tier ram
  std::unique_ptr<SwapStore> store;          // tier nvme: p, m, v of the flattened parameters
  // Overlap speculation fails only when clipping or an fp16 overflow can change the step; only then is an
  // undo copy kept.
  bool speculation_can_fail = false;
  AlignedBuffer undo_master, undo_exp_avg, undo_exp_avg_sq, undo_weights;
  // Device-copyable staging. Gradients: one set, two for delayed (step t reads one while iteration t+1's
  // come down into the other). Weights: the 16-bit copy the device holds.
  void* grad_staging[2] = {nullptr, nullptr};
  std::vector<GradStats> stats[2];  // per piece
  void* weight_staging = nullptr;
  int grad_set = 0;

  // This iteration: which parameters were reported, and which pieces stepped speculatively (overlap).
  std::vector<char> reported, stepped;
  std::atomic<bool> overflow_seen{false};
  Status worker_status;  // the first failure inside the worker
  std::unique_ptr<WorkQueue> worker;      // overlap: per-parameter steps during backward
  std::unique_ptr<WorkQueue> background;  // delayed: the step running beside the next iteration
  // delayed: the last step's weights wait to be sent (pending_h2d), the background step has finished
  // (update_done), which parameters' weights are on their way (h2d_sent), and the compute event after which
  // each reported parameter's weights may be overwritten (grad_done, 0: none), in report order (report_order). Guarded by h2d_mutex.
  std::mutex h2d_mutex;
  bool pending_h2d = false;
  bool update_done = false;
  std::vector<char> h2d_sent;
  std::vector<EventId> grad_done;
  std::vector<std::size_t> report_order;  // parameters in the order their gradients were reported

  // In place (a device whose memory is host memory, tier ram, not delayed): gradients are read where the
  // device keeps them, 16-bit weights written there, and an f32 parameter's device weights are its master.
  bool in_place = false;
  // Gradient statistics cost a pass over the gradients; in place, they are taken only when clipping or loss
  // scaling needs them (last_grad_norm is then 0).
  bool need_stats = true;
  float* master_of(std::size_t i) {
    if (in_place && params[i].dtype == DType::f32) return static_cast<float*>(params[i].device_weights);
    return master.as<float>() + offsets[i];
  }
  void* grad_of(std::size_t i, int set) {
    if (in_place) return const_cast<void*>(params[i].device_grads);
    return static_cast<unsigned char*>(grad_staging[set]) + grad_offsets[i];
  }
  void* weights_of(std::size_t i) {
    if (in_place) return params[i].device_weights;
    return static_cast<unsigned char*>(weight_staging) + weight_offsets[i];
  }
  AdamTensor tensor(const Piece& k, int set);

  Status allocate();
  Status load_initial_weights();
  // Gradients of parameter i down into staging `set`, with their statistics; `step_pieces` (overlap) also
  // steps each piece speculatively once it is down.
  Status enqueue_d2h(std::size_t i, int set, bool step_pieces);
  Status step_piece_when_down(std::size_t piece, EventId copied);
  Status enqueue_h2d(std::size_t i);
  Status enqueue_h2d(const Piece& k);
  // The compute stream (the next forward) waits for every weight sent so far; returns the event after which
  // the weight staging may be rewritten. finish_h2d() also waits for it on the host.
  Result<EventId> weights_sent();
  Status finish_h2d();
  Status adam_pieces(const std::vector<std::size_t>& which, float grad_scale, int set,
                     const std::vector<ParamGroup>& hyper);
  // The whole step over every parameter: CpuAdam over RAM, or streamed through the swap store.
  Status adam_all(float grad_scale, int set, const std::vector<ParamGroup>& hyper);
  Status open_store();
  // [offset, offset + count) of the flattened p (which 0), m (1) or v (2) into dst, wherever they live.
  Status read_flat(int which, std::size_t offset, std::size_t count, float* dst);
  void save_undo(const Piece& k);
  void restore_undo(const Piece& k);
  struct Decision {
    bool overflow;
    double grad_norm;
    float grad_scale;
    Status error;  // partitioned: the ranks could not agree (the collective failed); nothing was decided
    bool refused = false;  // a non-finite gradient without loss scaling, and refuse_non_finite: no step
  };
  // The error a refused step returns: which parameters hold NaN/Inf gradients (from the statistics of `set`).
  Status non_finite_error(int set) const;
  Decision decide(int set, float scale_used) const;
  void record_outcome(const Decision& d);

  Status step_sync();
  Status finish_sync_step();  // every gradient is on its way down: decide, step, send the weights up
  Status grad_ready_overlap(std::size_t i);
  Status step_overlap();
  Status grad_ready_delayed(std::size_t i);
  Status step_delayed();
  // Joins the background step and sends what is left of its weights; returns the event the host waits
  // for before the weight staging is written again.
  Result<EventId> flush_delayed();
  Status send_weights(std::size_t i);                      // with h2d_mutex held
  Status finish_background_step(const Status& status);  // the worker, as its last act
};

}  // namespace zoe
