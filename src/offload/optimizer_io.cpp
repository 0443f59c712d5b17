// OffloadOptimizer save/load: the whole optimizer state in one checkpoint file (checkpoint.h: atomic,
// checksummed), described by a manifest that load compares with this optimizer before touching anything.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "src/offload/checkpoint.h"
#include "src/offload/optimizer_impl.h"
#include "src/offload/optimizer_manifest.h"
#include "zoe/aligned_buffer.h"

namespace zoe {

namespace {

// What save() records beside the arrays: counters, groups, parameters, the partition, how the state was kept.
OptimizerManifest manifest_of(const OffloadOptimizer::Impl& m, bool record_names) {
  OptimizerManifest manifest;
  manifest.step = m.step_count.load();
  // Parameters that missed steps (no gradient) have their own count: recorded only then.
  if (std::any_of(m.param_steps.begin(), m.param_steps.end(), [&](std::int64_t t) { return t != manifest.step; })) {
    manifest.param_steps = m.param_steps;
  }
  manifest.loss_scale = m.scaler.state();
  manifest.rank = m.partition ? m.partition->comm->rank() : 0;
  manifest.world = m.partition ? m.partition->comm->world() : 1;
  manifest.rule = m.rule;
  for (const ParamGroup& g : m.groups) manifest.groups.push_back(g.hyper);
  for (const ParamSpec& p : m.params) manifest.params.push_back(manifest_param(p, record_names));
  if (m.partition) {
    // The trainer's parameters and where each of ours lies in them: every rank's checkpoint together
    // holds each parameter whole (PartitionedCheckpoint joins them).
    manifest.pieces_recorded = true;
    for (const ParamSpec& p : m.partition->user) manifest.user_params.push_back(manifest_param(p, record_names));
    for (const Piece& k : m.partition->origin) manifest.pieces.push_back({k.param, k.begin, k.n});
  }
  manifest.tier = std::string(tier_name(m.options.tier));
  // The moments are stored as fp32 whatever the run kept them in (bf16 widens exactly; i8 is decoded, and
  // its codes and scales are stored beside them for the run itself to resume exactly): recorded so that a
  // reader knows how they were kept.
  manifest.state_dtype = std::string(state_dtype_name(m.options.state_dtype));
  return manifest;
}

}  // namespace

Status OffloadOptimizer::save(const std::string& path, bool record_names) {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  // The manifest records the groups: ones the state arrays do not fit would make a file nothing loads.
  if (Status s = m.check_groups(); !s.ok()) return Status(s.code(), "save: " + s.message());
  if (Status s = wait(); !s.ok()) return s;
  // Tier nvme with durability checkpoint: the swap files become durable here, and only here.
  if (Status s = m.tier->flush(); !s.ok()) return s;
  const OptimizerManifest manifest = manifest_of(m, record_names);
  Result<CheckpointWriter> writer = CheckpointWriter::create(path);
  if (!writer.ok()) return writer.status();
  const std::size_t total = m.offsets.back();
  // The master and the rule's state arrays by name (Impl::state_blob). An array the tier does not hold
  // contiguously in RAM (tier nvme; in place, the master) streams out a slice at a time.
  AlignedBuffer slice;
  for (int k = 0; k <= static_cast<int>(m.state_count); ++k) {
    const float* contiguous = m.tier->flat(k);
    if (contiguous == nullptr && slice.data() == nullptr) {
      Result<AlignedBuffer> b = AlignedBuffer::allocate(CheckpointWriter::kStreamSlice);
      if (!b.ok()) return b.status();
      slice = std::move(b).value();
    }
    const Status s = writer->add_streamed(m.state_blob(k), total * 4, [&](std::size_t offset, std::size_t n, const void** out) {
      if (contiguous != nullptr) {
        *out = reinterpret_cast<const unsigned char*>(contiguous) + offset;
        return Status::success();
      }
      *out = slice.data();
      float* arrays[4] = {nullptr, nullptr, nullptr, nullptr};
      arrays[k] = slice.as<float>();
      return m.tier->read(offset / 4, n / 4, arrays[0], arrays[1], arrays[2], arrays[3]);
    });
    if (!s.ok()) return s;
  }
  if (Status s = m.tier->save_q8(writer.value()); !s.ok()) return s;
  // In place, the 16-bit weights are the device's own; with two state sets, in each parameter's current one.
  std::vector<unsigned char> weights16;
  if (m.in_place || !m.current_set.empty()) {
    weights16.resize(m.weight_offsets.back());
    for (std::size_t i = 0; i < m.params.size(); ++i) {
      const std::size_t bytes = m.weight_offsets[i + 1] - m.weight_offsets[i];
      if (bytes > 0) std::memcpy(weights16.data() + m.weight_offsets[i], m.weights_of(i), bytes);
    }
  }
  if (m.streamed) {
    // No staging: the weights are the masters rounded, slice by slice.
    std::vector<unsigned char> w16(CheckpointWriter::kStreamSlice);
    const Status s = writer->add_streamed("weights16", m.weight_offsets.back(),
                                          [&](std::size_t offset, std::size_t n, const void** out) {
                                            *out = w16.data();
                                            return m.tier->read_weights16(offset, n, w16.data());
                                          });
    if (!s.ok()) return s;
    return writer->commit(manifest.dump());
  }
  const void* w16 = !weights16.empty() ? static_cast<const void*>(weights16.data()) : m.weight_staging;
  if (Status s = writer->add("weights16", w16, m.weight_offsets.back()); !s.ok()) return s;
  return writer->commit(manifest.dump());
}

namespace {

Status refuse(const std::string& path, const std::string& why) {
  return Status(StatusCode::invalid_argument, "checkpoint " + path + " does not fit this optimizer: " + why);
}

// The partition and the parameters, compared with this optimizer's.
Status check_layout(const Impl& m, const OptimizerManifest& manifest, const std::string& path) {
  if (manifest.rule != m.rule) {
    return refuse(path, "it holds the state of " + std::string(optimizer_rule(manifest.rule).name) +
                            " and this optimizer runs " + std::string(optimizer_rule(m.rule).name));
  }
  if (!manifest.groups.empty() && state_arrays(manifest.groups[0]) != m.state_count) {
    const bool saved_max = manifest.groups[0].amsgrad;
    return refuse(path, std::string("it was written with amsgrad = ") + (saved_max ? "true" : "false") +
                            " (max_exp_avg_sq " + (saved_max ? "kept" : "not kept") + ") and this optimizer has amsgrad = " +
                            (m.first_hyper.amsgrad ? "true" : "false"));
  }
  const int my_rank = m.partition ? m.partition->comm->rank() : 0;
  const int my_world = m.partition ? m.partition->comm->world() : 1;
  if (manifest.rank != my_rank || manifest.world != my_world) {
    return refuse(path, "it was written by rank " + std::to_string(manifest.rank) + " of " + std::to_string(manifest.world) +
                            "; this optimizer is rank " + std::to_string(my_rank) + " of " + std::to_string(my_world));
  }
  if (manifest.params.size() != m.params.size()) {
    return refuse(path, "it holds " + std::to_string(manifest.params.size()) + " parameters, this optimizer " +
                            std::to_string(m.params.size()));
  }
  if (manifest.groups.size() != m.groups.size()) {
    return refuse(path, "it holds " + std::to_string(manifest.groups.size()) + " param groups, this optimizer " +
                            std::to_string(m.groups.size()));
  }
  for (std::size_t i = 0; i < manifest.params.size(); ++i) {
    const ManifestParam& saved = manifest.params[i];
    const ParamSpec& p = m.params[i];
    if (saved.n != p.n || saved.dtype != dtype_name(p.dtype) || saved.group != p.group) {
      return refuse(path, "parameter " + std::to_string(i) + " is n=" + std::to_string(saved.n) + " " + saved.dtype +
                              " in group " + std::to_string(saved.group) + " there, n=" + std::to_string(p.n) + " " +
                              std::string(dtype_name(p.dtype)) + " in group " + std::to_string(p.group) + " here");
    }
  }
  return Status::success();
}

// The loaded 16-bit weights (and, in place, the f32 masters the tier loaded) where the step reads them.
void place_weights(Impl& m, const AlignedBuffer& weights) {
  if (m.in_place) {
    // The device's weights are the ones to set: f32 masters and 16-bit copies alike.
    for (std::size_t i = 0; i < m.params.size(); ++i) {
      const ParamSpec& p = m.params[i];
      if (p.dtype == DType::f32) {
        std::memcpy(p.device_weights, m.tier->master(i), p.n * 4);
      } else if (p.n > 0) {
        std::memcpy(p.device_weights, weights.as<unsigned char>() + m.weight_offsets[i], p.n * 2);
      }
    }
  } else if (m.weight_offsets.back() > 0) {
    // Into the first set, which the tier's load made current for every parameter.
    std::memcpy(m.weight_staging, weights.data(), m.weight_offsets.back());
  }
}

}  // namespace

// Everything is read and checked into temporary buffers first: a refused or corrupt checkpoint leaves the
// optimizer as it was.
Status OffloadOptimizer::load(const std::string& path) {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  if (Status s = wait(); !s.ok()) return s;
  Result<CheckpointReader> reader = CheckpointReader::open(path);
  if (!reader.ok()) return reader.status();
  Result<OptimizerManifest> manifest = OptimizerManifest::parse(reader->manifest(), path);
  if (!manifest.ok()) return manifest.status();
  if (Status s = check_layout(m, manifest.value(), path); !s.ok()) return s;
  const std::int64_t step = manifest->step;
  // Streamed: the blob is only verified; the weights sent are the loaded masters rounded, as every step's are.
  Result<AlignedBuffer> weights = AlignedBuffer::allocate(m.streamed ? 0 : m.weight_offsets.back());
  if (!weights.ok()) return weights.status();
  const Status read = m.streamed ? reader->read_streamed("weights16", m.weight_offsets.back(), CheckpointWriter::kStreamSlice,
                                                         [](std::size_t, const void*, std::size_t) { return Status::success(); })
                                 : reader->read("weights16", weights->data(), m.weight_offsets.back());
  if (!read.ok()) return read;
  if (Status s = m.tier->load(reader.value(), path, step); !s.ok()) return s;
  if (!m.streamed) place_weights(m, *weights);
  // The store is the checkpoint's now: so are the counters, before anything that can fail.
  for (std::size_t g = 0; g < m.groups.size(); ++g) m.groups[g].hyper = manifest->groups[g];
  m.step_count = step;
  if (manifest->param_steps.empty()) {
    std::fill(m.param_steps.begin(), m.param_steps.end(), step);
  } else {
    m.param_steps = manifest->param_steps;
  }
  m.scaler.restore(manifest->loss_scale);
  m.visible_scale = m.scaler.scale();
  // Streamed: the loaded masters rounded and sent; a send that fails leaves its parameters marked unsent,
  // which the next step() sends first.
  if (m.streamed) {
    if (Status s = m.tier->resend_weights(nullptr); !s.ok()) return s;
  }
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    if (m.streamed && m.params[i].dtype != DType::f32) continue;  // sent above
    if (Status s = m.enqueue_h2d(i); !s.ok()) return s;
  }
  if (Status s = m.finish_h2d(); !s.ok()) return s;
  // Partitioned: this rank set its shard of the weights; every rank's are gathered into every parameter.
  return m.partition ? m.partition_gather_weights() : Status::success();
}

}  // namespace zoe
