// The state behind OffloadOptimizer, shared by its schedules (optimizer.cpp) and save/load
// (optimizer_io.cpp).
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "src/aligned_buffer.h"
#include "src/offload/loss_scaler.h"
#include "src/offload/work_queue.h"
#include "zoe/offload.h"

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

  // Element offsets of each parameter in the flat fp32 arrays, and byte offsets in the staging.
  std::vector<std::size_t> offsets, grad_offsets, weight_offsets;
  AlignedBuffer master, exp_avg, exp_avg_sq;
  // Overlap speculation fails only when clipping or an fp16 overflow can change the step; only then is an
  // undo copy kept.
  bool speculation_can_fail = false;
  AlignedBuffer undo_master, undo_exp_avg, undo_exp_avg_sq, undo_weights;
  // Device-copyable staging. Gradients: one set, two for delayed (step t reads one while iteration t+1's
  // come down into the other). Weights: the 16-bit copy the device holds.
  void* grad_staging[2] = {nullptr, nullptr};
  std::vector<GradStats> stats[2];
  void* weight_staging = nullptr;
  int grad_set = 0;

  // This iteration: which parameters were reported and which stepped speculatively (overlap).
  std::vector<char> reported, stepped;
  std::vector<EventId> d2h_events;
  std::atomic<bool> overflow_seen{false};
  Status worker_status;  // the first failure inside the worker
  std::unique_ptr<WorkQueue> worker;      // overlap: per-parameter steps during backward
  std::unique_ptr<WorkQueue> background;  // delayed: the step running beside the next iteration
  bool pending_h2d = false;               // delayed: weights of the last step not yet sent

  float* master_of(std::size_t i) { return master.as<float>() + offsets[i]; }
  void* grad_of(std::size_t i, int set) { return static_cast<unsigned char*>(grad_staging[set]) + grad_offsets[i]; }
  void* weights_of(std::size_t i) { return static_cast<unsigned char*>(weight_staging) + weight_offsets[i]; }
  AdamTensor tensor(std::size_t i, int set);

  Status allocate();
  Status load_initial_weights();
  Status enqueue_d2h(std::size_t i, int set);
  Status enqueue_h2d(std::size_t i);
  Status finish_h2d();  // the compute stream (next forward) waits for the weights; so does the host
  Status adam_params(const std::vector<std::size_t>& which, float grad_scale, int set,
                     const std::vector<ParamGroup>& hyper);
  void save_undo(std::size_t i);
  void restore_undo(std::size_t i);
  struct Decision {
    bool overflow;
    double grad_norm;
    float grad_scale;
  };
  Decision decide(int set, float scale_used) const;
  void record_outcome(const Decision& d);

  Status step_sync();
  Status grad_ready_overlap(std::size_t i);
  Status step_overlap();
  Status grad_ready_delayed(std::size_t i);
  Status step_delayed();
  Status flush_delayed();
};

}  // namespace zoe
