// The swap store's calls built on the tile pipeline (swap_pipeline.cpp): initialize, step, read, write.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>

#include "src/nvme/swap_impl.h"

namespace zoe {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

namespace {

// A tile that is written without being read starts as zeros: all-zero bytes are +0 in f32 and bf16 alike,
// and zero codes with zero scales decode to +0.
void zero_tile(const SwapStore::Impl& im, const TileArrays& a, std::size_t count) {
  std::memset(a.p, 0, count * 4);
  for (unsigned char* x : {a.m, a.v, a.vmax}) {
    if (x != nullptr) std::memset(x, 0, count * im.moment_bytes);
  }
  for (float* x : {a.m_scale, a.v_scale}) {
    if (x != nullptr) std::memset(x, 0, moment_blocks(count) * 4);
  }
}

// Runs the common frame of a streaming call: checks, the pipeline, fdatasync and the table update, stats.
template <typename Body>
Status streaming_call(SwapStore::Impl& im, bool writes, Body&& body) {
  const auto t0 = Clock::now();
  if (Status s = im.refuse_while_speculating("this call"); !s.ok()) return s;
  im.stats = {};
  if (Status s = im.ready_for_io(); !s.ok()) return s;
  // A resident store settles the last call's writes first: they complete into its counters, not this call's.
  if (im.keeps_resident()) {
    if (Status s = im.settle(); !s.ok()) return im.with_state(std::move(s));
  }
  im.engine->reset_counters();
  const std::vector<TileEntry> before = im.table;
  Status s = body();
  const aio::EngineCounters c = im.engine->counters();
  // Settled above, so what is pending now is this call's: writes it left in flight, not yet counted.
  const std::uint64_t behind = im.pending_writes.size() * im.slot_bytes;
  const bool wrote = writes && (c.write_bytes > 0 || behind > 0);
  Status persisted = im.after_call(before, wrote);
  im.stats.read_bytes = c.read_bytes;
  im.stats.write_bytes = behind > 0 ? behind : c.write_bytes;
  im.stats.read_s = c.read_busy_s;
  im.stats.write_s = c.write_busy_s;
  im.stats.total_s = since(t0);
  if (s.ok()) s = std::move(persisted);
  else if (!persisted.ok()) s = Status(s.code(), s.message() + "; then: " + persisted.message(), s.sys_errno());
  return im.with_state(std::move(s));
}

}  // namespace

Status SwapStore::initialize(const std::function<Status(std::size_t, std::size_t, float*)>& fill, std::int64_t step) {
  Impl& im = *impl_;
  if (!fill) return invalid_argument("initialize: the fill callback is empty");
  if (step < 0) return invalid_argument("initialize: step = " + std::to_string(step) + " must be >= 0");
  std::vector<TileTask> tasks(im.ntiles);
  for (std::size_t t = 0; t < im.ntiles; ++t) tasks[t] = {t, false, true, step};
  return streaming_call(im, true, [&] {
    return im.run_tiles(tasks, [&](const TileTask& task, const TileArrays& a, std::size_t count) {
      zero_tile(im, a, count);  // m = v = 0; fill() writes p
      Status s = fill(im.tile_begin(task.tile), count, a.p);
      if (!s.ok()) {
        return Status(s.code(), "initialize: the fill callback failed for elements [" + std::to_string(im.tile_begin(task.tile)) +
                                    ", " + std::to_string(im.tile_begin(task.tile) + count) + "): " + s.message(),
                      s.sys_errno());
      }
      return Status::success();
    });
  });
}

namespace {

// The tiles a step touches, in order, each with the first segment touching it; `skipped` counts the tiles
// already at the step (a retry), which are read only where a segment wants its copy-out refilled.
struct StepPlan {
  std::vector<TileTask> tasks;
  std::vector<std::size_t> first_segment;
  std::size_t skipped = 0;
};

Status plan_step(const SwapStore::Impl& im, std::span<const SwapSegment> segments, std::int64_t step,
                 StepPlan& plan) {
  std::vector<TileTask>& tasks = plan.tasks;
  std::vector<std::size_t>& first_segment = plan.first_segment;
  auto needs_out = [&](std::size_t t, std::size_t si) {
    for (; si < segments.size() && segments[si].offset < im.tile_begin(t) + im.tile_count(t); ++si) {
      if (segments[si].n > 0 && segments[si].out != nullptr && segments[si].offset + segments[si].n > im.tile_begin(t)) return true;
    }
    return false;
  };
  for (std::size_t si = 0; si < segments.size(); ++si) {
    const SwapSegment& seg = segments[si];
    if (seg.n == 0) continue;
    for (std::size_t t = seg.offset / im.tile; t <= (seg.offset + seg.n - 1) / im.tile; ++t) {
      if (!first_segment.empty() && tasks.back().tile == t) continue;
      const std::int64_t at = im.table[t].step;
      if (at < 0) return invalid_argument(im.unwritten(t));
      if (at > step) {
        return invalid_argument(im.tile_name(t) + " is at step " + std::to_string(at) + ", past step " +
                                std::to_string(step) + ": steps must not go backwards (set_step() after a load)");
      }
      const bool retry = at == step;
      if (retry) ++plan.skipped;
      if (retry && !needs_out(t, si)) {
        first_segment.push_back(si);
        tasks.push_back({t, false, false, at});  // placeholder so later segments see the tile; removed below
        continue;
      }
      tasks.push_back({t, true, !retry, step});
      first_segment.push_back(si);
    }
  }
  std::size_t w = 0;
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    if (!tasks[i].read && !tasks[i].write) continue;
    tasks[w] = tasks[i];
    first_segment[w++] = first_segment[i];
  }
  tasks.resize(w);
  first_segment.resize(w);
  return Status::success();
}

// The plan's tasks (and their first segments) stably sorted by the rank of their tiles.
void order_by_rank(const SwapStore::Impl& im, StepPlan& plan, const SwapStore::TileRank& rank) {
  std::vector<std::size_t> ranks(plan.tasks.size()), order(plan.tasks.size());
  for (std::size_t k = 0; k < plan.tasks.size(); ++k) {
    const std::size_t t = plan.tasks[k].tile;
    ranks[k] = rank(im.tile_begin(t), im.tile_begin(t) + im.tile_count(t));
    order[k] = k;
  }
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return ranks[a] < ranks[b]; });
  StepPlan sorted;
  sorted.skipped = plan.skipped;
  for (std::size_t k : order) {
    sorted.tasks.push_back(plan.tasks[k]);
    sorted.first_segment.push_back(plan.first_segment[k]);
  }
  plan = std::move(sorted);
}

// The step's compute stage: Adam over the segments' parts in one tile (after the gate, when speculating).
class TileStepper {
 public:
  TileStepper(const SwapStore::Impl& im, std::span<const SwapSegment> segments, const StepPlan& plan,
              const StepOptions& options, const SwapStore::TileGate* gate)
      : im_(im), segments_(segments), plan_(plan), options_(options), adam_options_(options), gate_(gate) {
    adam_options_.check_finite = false;  // checked above, over all segments, before anything changed
  }

  Status operator()(const TileTask& task, const TileArrays& a, std::size_t count) {
    if (gate_ != nullptr) {
      const auto g0 = Clock::now();
      const Status s = (*gate_)(im_.tile_begin(task.tile), im_.tile_begin(task.tile) + count);
      gate_s_ += since(g0);
      if (!s.ok()) return s;
    }
    const auto t0 = Clock::now();
    gather(task, a, count);
    Status r;
    for (const Call& g : groups_) {
      if ((g.tensors.empty() && g.one_state.empty()) || !r.ok()) continue;
      StepOptions o = adam_options_;
      o.step = g.step;
      r = step_rule(*im_.adam, *g.hyper, o, g.tensors, g.one_state);
    }
    for (std::size_t k = 0; r.ok() && k < f32_out_.size(); ++k) copy_out(f32_out_[k].p, f32_out_[k].out, DType::f32, f32_out_[k].n);
    adam_s_ += since(t0);
    if (!r.ok()) return Status(r.code(), "the step on " + im_.tile_name(task.tile) + ": " + r.message(), r.sys_errno());
    return r;
  }

  double adam_s() const { return adam_s_; }
  double gate_s() const { return gate_s_; }

 private:
  struct Call {
    const OptimizerHyper* hyper;
    std::int64_t step;
    std::vector<AdamTensor> tensors;        // Adam
    std::vector<OneStateTensor> one_state;  // Lion, Adagrad
  };
  // An f32 `out` (an fp32 parameter's device weights are its master; the kernel writes 16-bit copies only):
  // the stepped master is copied there after the tile's Adam calls.
  struct F32Out { const float* p; void* out; std::size_t n; };

  // One Adam call per set of hyper-parameters in the tile (param groups often alternate, e.g. weights
  // with weight decay and norms without): each call is a parallel pass with its own start-up cost.
  void gather(const TileTask& task, const TileArrays& a, std::size_t count) {
    const std::size_t begin = im_.tile_begin(task.tile), end = begin + count;
    const std::size_t index = static_cast<std::size_t>(&task - plan_.tasks.data());
    for (Call& g : groups_) {
      g.tensors.clear();
      g.one_state.clear();
    }
    f32_out_.clear();
    for (std::size_t si = plan_.first_segment[index]; si < segments_.size() && segments_[si].offset < end; ++si) {
      const SwapSegment& seg = segments_[si];
      const std::size_t lo = std::max(begin, seg.offset), hi = std::min(end, seg.offset + seg.n);
      if (seg.n == 0 || lo >= hi || seg.grad == nullptr) continue;  // null: the gate left it out
      const std::size_t at = lo - begin, from = lo - seg.offset;
      void* out = seg.out == nullptr ? nullptr : static_cast<char*>(seg.out) + from * dtype_size(seg.out_dtype);
      if (!task.write) {  // a retried tile: already stepped, only its copy-out is refilled
        if (out != nullptr) copy_out(a.p + at, out, seg.out_dtype, hi - lo);
        continue;
      }
      if (out != nullptr && seg.out_dtype == DType::f32) {
        f32_out_.push_back({a.p + at, out, hi - lo});
        out = nullptr;
      }
      const std::int64_t step = seg.step > 0 ? seg.step : options_.step;
      auto group = std::find_if(groups_.begin(), groups_.end(),
                                [&](const Call& g) { return g.hyper == seg.hyper && g.step == step; });
      if (group == groups_.end()) group = groups_.insert(groups_.end(), Call{seg.hyper, step, {}, {}});
      const AdamTensor t = tensor(a, at, seg, from, out, hi - lo);
      if (a.v != nullptr) {
        group->tensors.push_back(t);
      } else {  // one state array: m
        group->one_state.push_back(one_state_of(t));
      }
    }
  }

  AdamTensor tensor(const TileArrays& a, std::size_t at, const SwapSegment& seg, std::size_t from, void* out,
                    std::size_t n) const {
    AdamTensor t;
    t.param = a.p + at;
    t.exp_avg = a.m + at * im_.moment_bytes;
    t.exp_avg_sq = a.v == nullptr ? nullptr : a.v + at * im_.moment_bytes;
    t.max_exp_avg_sq = a.vmax == nullptr ? nullptr : a.vmax + at * im_.moment_bytes;
    t.state_dtype = im_.options.state_dtype;
    if (a.m_scale != nullptr) {  // i8: `at` is a block boundary (check_segments, tile % kMomentBlock == 0)
      t.exp_avg_scale = a.m_scale + at / kMomentBlock;
      t.exp_avg_sq_scale = a.v_scale == nullptr ? nullptr : a.v_scale + at / kMomentBlock;
    }
    t.grad = static_cast<const char*>(seg.grad) + from * dtype_size(seg.grad_dtype);
    t.grad_dtype = seg.grad_dtype;
    t.out = out;
    t.out_dtype = seg.out_dtype;
    t.n = n;
    return t;
  }

  const SwapStore::Impl& im_;
  std::span<const SwapSegment> segments_;
  const StepPlan& plan_;
  const StepOptions& options_;
  StepOptions adam_options_;
  const SwapStore::TileGate* gate_;
  std::vector<Call> groups_;
  std::vector<F32Out> f32_out_;
  double adam_s_ = 0, gate_s_ = 0;
};

}  // namespace

Status step_tiles(SwapStore::Impl& im, std::span<const SwapSegment> segments, const StepOptions& options,
                  const SwapStore::TileGate* gate, const SwapStore::TileRank* rank) {
  if (options.step < 1) return invalid_argument("step = " + std::to_string(options.step) + ": steps count from 1");
  if (Status s = im.refuse_while_speculating(gate != nullptr ? "speculate()" : "step()"); !s.ok()) return s;
  if (Status s = check_segments(segments, im.n, im.scale_count > 0, im.state_arrays); !s.ok()) return s;
  if (options.check_finite && gate == nullptr) {
    if (Status s = check_finite_grads(segments); !s.ok()) return s;
  }
  StepPlan plan;
  if (Status s = plan_step(im, segments, options.step, plan); !s.ok()) return s;
  if (gate != nullptr) {
    // Backward reports the last parameters first; a rank says better where it is known.
    std::reverse(plan.tasks.begin(), plan.tasks.end());
    std::reverse(plan.first_segment.begin(), plan.first_segment.end());
    if (rank != nullptr) order_by_rank(im, plan, *rank);
    for (TileTask& t : plan.tasks) t.speculative = true;
  }
  TileStepper stepper(im, segments, plan, options, gate);
  // A speculative call flips no entry: its durability is commit_speculation()'s.
  Status s = streaming_call(im, gate == nullptr, [&] {
    return im.run_tiles(plan.tasks, [&stepper](const TileTask& task, const TileArrays& a, std::size_t count) {
      return stepper(task, a, count);
    });
  });
  if (gate != nullptr) im.speculating = true;  // commit or discard, whatever the call did
  im.stats.adam_s = stepper.adam_s();
  im.stats.gate_s = stepper.gate_s();
  im.stats.tiles_skipped = plan.skipped;
  for (const TileTask& t : plan.tasks) {
    const TileEntry& e = t.speculative ? im.speculated[t.tile] : im.table[t.tile];
    if (t.write && e.step == options.step) ++im.stats.tiles_stepped;
  }
  if (!s.ok() && gate != nullptr) {
    return Status(s.code(), "speculative step " + std::to_string(options.step) + " stopped: " + s.message() +
                                " (discard_speculation() leaves the store as it was)", s.sys_errno());
  }
  if (!s.ok()) {
    return Status(s.code(), "step " + std::to_string(options.step) + " incomplete: " + s.message() +
                                ". Call step() again with the same gradients once the cause is fixed: it completes only "
                                "the tiles still at an older step",
                  s.sys_errno());
  }
  return s;
}

Status SwapStore::step(std::span<const SwapSegment> segments, const StepOptions& options) {
  return step_tiles(*impl_, segments, options, nullptr);
}

namespace {

// An array of the store (fp32, or bf16 moments) to fp32 and back; bf16 widens exactly and is rounded to
// nearest even, as the kernels round it.
void widen(const unsigned char* src, std::size_t size, float* dst, std::size_t n) {
  if (size == 4) {
    std::memcpy(dst, src, n * 4);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t b;
    std::memcpy(&b, src + 2 * i, 2);
    dst[i] = bf16_to_float(b);
  }
}

void narrow(const float* src, unsigned char* dst, std::size_t size, std::size_t n) {
  if (size == 4) {
    std::memcpy(dst, src, n * 4);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint16_t b = float_to_bf16(src[i]);
    std::memcpy(dst + 2 * i, &b, 2);
  }
}

// i8 moments of tile elements [lo, hi) (tile-relative) to fp32 m[0, hi - lo) and v (either may be null), block
// by block; or, `in`, from them: each block touched is decoded, its covered part replaced and encoded again
// with new scales. Only the moment given is re-encoded: the other keeps its codes and scales bit for bit.
void q8_moments(const TileArrays& a, std::size_t count, std::size_t lo, std::size_t hi, float* m, float* v, bool in) {
  float tm[kMomentBlock], tv[kMomentBlock];
  alignas(64) std::int8_t mq[kMomentBlock];
  alignas(64) std::uint8_t vq[kMomentBlock];
  auto* codes_m = reinterpret_cast<std::int8_t*>(a.m);
  auto* codes_v = a.v;  // null: Lion's one moment
  float* tvs = codes_v == nullptr ? nullptr : tv;
  for (std::size_t j = lo / kMomentBlock; j * kMomentBlock < hi; ++j) {
    const std::size_t start = j * kMomentBlock, nb = std::min(kMomentBlock, count - start);
    decode_moments(codes_m + start, codes_v == nullptr ? nullptr : codes_v + start, a.m_scale + j,
                   a.v_scale == nullptr ? nullptr : a.v_scale + j, nb, tm, tvs);
    const std::size_t from = std::max(lo, start), to = std::min(hi, start + nb);
    for (std::size_t x = from; x < to; ++x) {
      if (in) {
        if (m != nullptr) tm[x - start] = m[x - lo];
        if (v != nullptr) tv[x - start] = v[x - lo];
      } else {
        if (m != nullptr) m[x - lo] = tm[x - start];
        if (v != nullptr) v[x - lo] = tv[x - start];
      }
    }
    if (!in) continue;
    float ms, vs;
    encode_moments(tm, tvs, nb, mq, vq, &ms, &vs);
    if (m != nullptr) {
      std::memcpy(codes_m + start, mq, nb);
      a.m_scale[j] = ms;
    }
    if (v != nullptr) {
      std::memcpy(codes_v + start, vq, nb);
      a.v_scale[j] = vs;
    }
  }
}

// The tasks of a read or write of [offset, offset + count): every tile it touches.
Result<std::vector<TileTask>> range_tasks(const SwapStore::Impl& im, std::size_t offset, std::size_t count, bool write,
                                          bool whole_arrays, const char* what) {
  if (Status s = check_range(offset, count, im.n, what); !s.ok()) return s;
  std::vector<TileTask> tasks;
  for (std::size_t t = offset / im.tile; count > 0 && t <= (offset + count - 1) / im.tile; ++t) {
    const bool written = im.table[t].step >= 0;
    if (!write) {
      if (!written) return invalid_argument(std::string(what) + ": " + im.unwritten(t));
      tasks.push_back({t, true, false, im.table[t].step});
      continue;
    }
    const std::size_t begin = im.tile_begin(t);
    const bool whole = whole_arrays && offset <= begin && offset + count >= begin + im.tile_count(t);
    // A tile never written has nothing valid to merge with: its missing parts start at zero.
    tasks.push_back({t, written && !whole, true, written ? im.table[t].step : 0});
  }
  return tasks;
}

// A v or vmax for a store that does not keep it.
Status kept_arrays(const SwapStore::Impl& im, const float* v, const float* vmax, const char* what) {
  if (v != nullptr && im.state_arrays < 2) {
    return invalid_argument(std::string(what) + ": swap store " + im.name + " keeps one state array (m): pass v = null");
  }
  if (vmax != nullptr && im.state_arrays < 3) {
    return invalid_argument(std::string(what) + ": swap store " + im.name + " keeps no vmax (amsgrad): pass null");
  }
  return Status::success();
}

}  // namespace

Status SwapStore::read(std::size_t offset, std::size_t count, float* p, float* m, float* v, float* vmax) {
  Impl& im = *impl_;
  if (Status s = kept_arrays(im, v, vmax, "read"); !s.ok()) return s;
  Result<std::vector<TileTask>> tasks = range_tasks(im, offset, count, false, false, "read");
  if (!tasks.ok()) return tasks.status();
  if (count == 0) return Status::success();
  return streaming_call(im, false, [&] {
    return im.run_tiles(tasks.value(), [&](const TileTask& task, const TileArrays& a, std::size_t tcount) {
      const std::size_t begin = im.tile_begin(task.tile);
      const std::size_t lo = std::max(begin, offset) - begin, hi = std::min(begin + tcount, offset + count) - begin;
      const std::size_t out = begin + lo - offset;
      if (p != nullptr) std::memcpy(p + out, a.p + lo, (hi - lo) * 4);
      if (im.scale_count > 0) {
        if (m != nullptr || v != nullptr) q8_moments(a, tcount, lo, hi, m == nullptr ? nullptr : m + out, v == nullptr ? nullptr : v + out, false);
        return Status::success();
      }
      if (m != nullptr) widen(a.m + lo * im.moment_bytes, im.moment_bytes, m + out, hi - lo);
      if (v != nullptr) widen(a.v + lo * im.moment_bytes, im.moment_bytes, v + out, hi - lo);
      if (vmax != nullptr) widen(a.vmax + lo * im.moment_bytes, im.moment_bytes, vmax + out, hi - lo);
      return Status::success();
    });
  });
}

Status SwapStore::write(std::size_t offset, std::size_t count, const float* p, const float* m, const float* v,
                        const float* vmax) {
  Impl& im = *impl_;
  if (Status s = kept_arrays(im, v, vmax, "write"); !s.ok()) return s;
  const bool whole = p != nullptr && m != nullptr && (v != nullptr || im.state_arrays < 2) &&
                     (vmax != nullptr || im.state_arrays < 3);
  Result<std::vector<TileTask>> tasks = range_tasks(im, offset, count, true, whole, "write");
  if (!tasks.ok()) return tasks.status();
  if (count == 0) return Status::success();
  return streaming_call(im, true, [&] {
    return im.run_tiles(tasks.value(), [&](const TileTask& task, const TileArrays& a, std::size_t tcount) {
      const std::size_t begin = im.tile_begin(task.tile);
      const std::size_t lo = std::max(begin, offset) - begin, hi = std::min(begin + tcount, offset + count) - begin;
      const std::size_t in = begin + lo - offset;
      if (!task.read) zero_tile(im, a, tcount);
      if (p != nullptr) std::memcpy(a.p + lo, p + in, (hi - lo) * 4);
      if (im.scale_count > 0) {
        if (m != nullptr || v != nullptr) {
          q8_moments(a, tcount, lo, hi, const_cast<float*>(m == nullptr ? nullptr : m + in),
                     const_cast<float*>(v == nullptr ? nullptr : v + in), true);
        }
        return Status::success();
      }
      if (m != nullptr) narrow(m + in, a.m + lo * im.moment_bytes, im.moment_bytes, hi - lo);
      if (v != nullptr) narrow(v + in, a.v + lo * im.moment_bytes, im.moment_bytes, hi - lo);
      if (vmax != nullptr) narrow(vmax + in, a.vmax + lo * im.moment_bytes, im.moment_bytes, hi - lo);
      return Status::success();
    });
  });
}

namespace {

// i8 moments as stored, between the store and caller arrays: the codes of [offset, offset + count) and the
// scales of the blocks those elements fall in (the caller's first scale is block offset / kMomentBlock). `in`:
// into the store. A null array is skipped (kept as stored).
Status transfer_q8(SwapStore::Impl& im, std::size_t offset, std::size_t count, std::int8_t* mq, std::uint8_t* vq,
                   float* m_scale, float* v_scale, bool in) {
  const char* what = in ? "write_q8" : "read_q8";
  if (im.scale_count == 0) {
    return invalid_argument(std::string(what) + ": the store holds " + std::string(dtype_name(im.options.state_dtype)) +
                            " moments, not i8 codes");
  }
  if ((vq != nullptr || v_scale != nullptr) && im.state_arrays < 2) {
    return invalid_argument(std::string(what) + ": swap store " + im.name + " keeps one moment (m): pass vq and "
                            "v_scale null");
  }
  Result<std::vector<TileTask>> tasks = range_tasks(im, offset, count, in, false, what);
  if (!tasks.ok()) return tasks.status();
  if (count == 0) return Status::success();
  const std::size_t first_block = offset / kMomentBlock;
  return streaming_call(im, in, [&] {
    return im.run_tiles(tasks.value(), [&](const TileTask& task, const TileArrays& a, std::size_t tcount) {
      const std::size_t begin = im.tile_begin(task.tile);
      const std::size_t lo = std::max(begin, offset) - begin, hi = std::min(begin + tcount, offset + count) - begin;
      if (!task.read) zero_tile(im, a, tcount);
      auto move = [in](void* tile_side, void* caller_side, std::size_t bytes) {
        if (in) std::memcpy(tile_side, caller_side, bytes);
        else std::memcpy(caller_side, tile_side, bytes);
      };
      const std::size_t at = begin + lo - offset;
      if (mq != nullptr) move(a.m + lo, mq + at, hi - lo);
      if (vq != nullptr) move(a.v + lo, vq + at, hi - lo);
      const std::size_t b0 = lo / kMomentBlock, b1 = (hi + kMomentBlock - 1) / kMomentBlock;
      const std::size_t scale_at = begin / kMomentBlock + b0 - first_block;
      if (m_scale != nullptr) move(a.m_scale + b0, m_scale + scale_at, (b1 - b0) * 4);
      if (v_scale != nullptr) move(a.v_scale + b0, v_scale + scale_at, (b1 - b0) * 4);
      return Status::success();
    });
  });
}

}  // namespace

Status SwapStore::read_q8(std::size_t offset, std::size_t count, std::int8_t* mq, std::uint8_t* vq, float* m_scale,
                          float* v_scale) {
  return transfer_q8(*impl_, offset, count, mq, vq, m_scale, v_scale, false);
}

Status SwapStore::write_q8(std::size_t offset, std::size_t count, const std::int8_t* mq, const std::uint8_t* vq,
                           const float* m_scale, const float* v_scale) {
  // Only read from in this direction.
  return transfer_q8(*impl_, offset, count, const_cast<std::int8_t*>(mq), const_cast<std::uint8_t*>(vq),
                     const_cast<float*>(m_scale), const_cast<float*>(v_scale), true);
}

Status SwapStore::discard() {
  Impl& im = *impl_;
  if (Status s = im.refuse_while_speculating("discard()"); !s.ok()) return s;
  if (Status s = im.settle(); !s.ok()) return s;
  for (TileEntry& e : im.table) e.step = -1;
  std::fill(im.resident.begin(), im.resident.end(), 0);
  return Status::success();
}

Status SwapStore::set_step(std::int64_t step) {
  Impl& im = *impl_;
  if (step < 0) return invalid_argument("set_step: step = " + std::to_string(step) + " must be >= 0");
  if (Status s = im.refuse_while_speculating("set_step()"); !s.ok()) return s;
  for (std::size_t t = 0; t < im.ntiles; ++t) {
    if (im.table[t].step < 0) return invalid_argument("set_step: " + im.unwritten(t));
  }
  if (Status s = im.settle(); !s.ok()) return s;
  for (TileEntry& e : im.table) e.step = step;
  im.unsynced = true;  // the new step numbers (and any write() before them) become durable together
  return im.flush();
}

}  // namespace zoe
