// Tier nvme: the fp32 master weights and moments of the flattened parameters in a swap store (zoe/swap.h),
// streamed through a few RAM buffers by each step; never whole in RAM. With i8 moments every parameter starts
// on a block of the store (kMomentBlock elements; the gap after a parameter holds zeros that no step
// touches), so its blocks and their scales are the ones tier ram keeps, and both tiers step the same bits.
//
// f32 parameters (an fp32 model, PEFT's fp32 adapters on a 16-bit base): the device's weights are the master
// itself. The store keeps that master with its moments as it keeps any other (one layout, one checkpoint
// format, the same streaming), and the step copies each stepped master into a device-copyable copy
// (master(i): SwapSegment::out in f32), which is sent up as a 16-bit parameter's staging is. Keeping those
// masters in RAM beside the store instead would split a tile's state between two places, and tier nvme
// exists for states that do not fit in RAM; the copy costs the 4 bytes per element the device holds anyway.
// Each step writes the master bits tier ram steps, so the tiers stay bit-identical.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "src/offload/checkpoint.h"
#include "src/offload/footprint.h"
#include "src/offload/optimizer_impl.h"
#include "src/offload/step_windows.h"
#include "zoe/swap.h"

namespace zoe {
#ifdef ZOE_HAVE_AIO
namespace {

class NvmeTier final : public StateTier {
 public:
  NvmeTier(Impl& m, SwapStore store, std::vector<std::size_t> at) : m_(m), store_(std::move(store)), at_(std::move(at)) {}
  ~NvmeTier() override { m_.device.free_host(f32_copies_); }

  // The device-copyable copies of the f32 parameters' masters, one array for all of them.
  Status allocate() {
    f32_at_.assign(m_.params.size(), 0);
    std::size_t total = 0;
    for (std::size_t i = 0; i < m_.params.size(); ++i) {
      f32_at_[i] = total;
      if (m_.params[i].dtype == DType::f32) total += m_.params[i].n;
    }
    if (m_.streamed) {
      Result<std::unique_ptr<StepWindows>> w = StepWindows::make(m_, store_, at_, store_.tile());
      if (!w.ok()) return w.status();
      windows_ = std::move(w).value();
    }
    if (total == 0) return Status::success();
    Result<void*> r = m_.device.allocate_host(total * 4);
    if (!r.ok()) return r.status();
    f32_copies_ = static_cast<float*>(r.value());
    return Status::success();
  }

  float* master(std::size_t i) override {
    return m_.params[i].dtype == DType::f32 ? f32_copies_ + f32_at_[i] : nullptr;
  }

  // The store starts from the device's weights (16-bit ones widened), tile by tile.
  Status initialize() override {
    return store_.initialize([this](std::size_t offset, std::size_t count, float* p) {
      const std::size_t end = offset + count;
      std::memset(p, 0, count * 4);  // the gaps between parameters
      std::size_t i = static_cast<std::size_t>(std::upper_bound(at_.begin(), at_.end(), offset) - at_.begin()) - 1;
      for (; i < m_.params.size() && at_[i] < end; ++i) {
        const std::size_t lo = std::max(offset, at_[i]), hi = std::min(end, at_[i] + m_.params[i].n);
        if (m_.params[i].dtype == DType::f32) {
          if (hi > lo) std::memcpy(p + (lo - offset), master(i) + (lo - at_[i]), (hi - lo) * 4);
          continue;
        }
        if (windows_) {
          if (Status s = windows_->widen(i, lo - at_[i], hi - lo, p + (lo - offset)); !s.ok()) return s;
          continue;
        }
        const auto* w = static_cast<const std::uint16_t*>(m_.weights_of(i)) + (lo - at_[i]);
        const bool f16 = m_.params[i].dtype == DType::f16;
        for (std::size_t k = 0; k + lo < hi; ++k) p[lo - offset + k] = f16 ? f16_to_float(w[k]) : bf16_to_float(w[k]);
      }
      return Status::success();
    });
  }

  // Every parameter in one streamed pass: the store cannot step pieces one at a time.
  Status step(const std::vector<std::size_t>& which, float grad_scale, int set,
              const std::vector<ParamGroup>& hyper, bool aside) override {
    if (aside) return invalid_argument("tier nvme keeps no second state set in RAM: it speculates in the swap store (speculate())");
    if (which.size() != m_.pieces.size()) {
      return invalid_argument("tier nvme steps every piece at once (" + std::to_string(which.size()) + " of " +
                              std::to_string(m_.pieces.size()) + " asked)");
    }
    if (windows_) {
      SwapStats io;
      const auto t0 = std::chrono::steady_clock::now();
      const Status s = windows_->step(grad_scale, set, hyper, &io);
      io.total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      add_stats(io);
      return s;
    }
    std::vector<SwapSegment> segments;
    for (std::size_t i = 0; i < m_.params.size(); ++i) {
      const ParamSpec& p = m_.params[i];
      if (p.n == 0 || m_.is_absent(i, set)) continue;  // no gradient: its tiles are not visited for it
      DType grad_dtype;
      const void* grad = m_.step_grad(i, set, &grad_dtype);
      segments.push_back({at_[i], p.n, &hyper[p.group].hyper, grad, grad_dtype, out_of(i), p.dtype, m_.bias_step(i)});
    }
    StepOptions o;
    o.step = m_.step_count.load() + 1;
    o.grad_scale = grad_scale;
    const Status s = store_.step(segments, o);
    add_stats(store_.last_stats());
    return s;
  }

  Status read(std::size_t offset, std::size_t count, float* p, float* m, float* v, float* vmax) override {
    return through_gaps(offset, count, {{p, 4}, {m, 4}, {v, 4}, {vmax, 4}}, false,
                        [&](std::size_t at, std::size_t n, const std::vector<void*>& a) {
                          return store_.read(at, n, static_cast<float*>(a[0]), static_cast<float*>(a[1]),
                                             static_cast<float*>(a[2]), static_cast<float*>(a[3]));
                        });
  }
  Status write(std::size_t offset, std::size_t count, const float* p, const float* m, const float* v,
               const float* vmax) override {
    return through_gaps(offset, count,
                        {{const_cast<float*>(p), 4}, {const_cast<float*>(m), 4}, {const_cast<float*>(v), 4},
                         {const_cast<float*>(vmax), 4}},
                        true, [&](std::size_t at, std::size_t n, const std::vector<void*>& a) {
                          return store_.write(at, n, static_cast<const float*>(a[0]), static_cast<const float*>(a[1]),
                                              static_cast<const float*>(a[2]), static_cast<const float*>(a[3]));
                        });
  }

  // The state does not fit in RAM: verify every blob first, then stream it into the swap store.
  Status load(const CheckpointReader& reader, const std::string& path, std::int64_t step) override {
    const std::size_t total = m_.offsets.back();
    // An i8 run's own codes and scales resume it exactly; fp32 moments (any other run) are encoded.
    const bool codes = q8() && reader.has(kQ8Blobs[0]);
    struct Blob {
      std::string name;
      std::size_t bytes;
      int array;  // the fp32 array (0 master, then the states) or, for codes, its index in kQ8Blobs
    };
    std::vector<Blob> blobs = {{"master", total * 4, 0}};
    if (codes) {
      for (int k = 0; k < 4; ++k) {
        if (q8_blob_kept(k)) blobs.push_back({kQ8Blobs[k], k < 2 ? total : blocks() * 4, k});
      }
    } else {
      for (int k = 1; k <= static_cast<int>(m_.state_count); ++k) blobs.push_back({m_.state_blob(k), total * 4, k});
    }
    for (const Blob& b : blobs) {
      const Status s = reader.read_streamed(b.name, b.bytes, CheckpointWriter::kStreamSlice,
                                            [](std::size_t, const void*, std::size_t) { return Status::success(); });
      if (!s.ok()) return s;
    }
    // The checkpoint replaces every element: nothing of the store is read back, so a store whose tiles fail
    // their checksums is recovered in place.
    if (Status s = store_.discard(); !s.ok()) return s;
    for (std::size_t k = 0; k < blobs.size(); ++k) {
      const Status s = k == 0 || !codes ? load_fp32(reader, blobs[k].name, blobs[k].array)
                                        : load_q8(reader, blobs[k].name, blobs[k].array);
      if (!s.ok()) {
        return Status(s.code(), s.message() + " — while loading " + path + " into the swap store, whose state is now "
                                "partly the checkpoint's: load again, or start afresh", s.sys_errno());
      }
    }
    if (Status s = store_.set_step(step); !s.ok()) return s;
    return copy_f32_masters(nullptr);
  }

  // The codes in flat order (without the gaps) and the scales of every block, which are each parameter's
  // blocks in parameter order: the blobs tier ram writes.
  Status save_q8(CheckpointWriter& writer) override {
    if (!q8()) return Status::success();
    std::vector<unsigned char> slice(CheckpointWriter::kStreamSlice);
    for (int k = 0; k < 4; ++k) {
      if (!q8_blob_kept(k)) continue;
      const std::size_t bytes = k < 2 ? m_.offsets.back() : blocks() * 4;
      const Status s = writer.add_streamed(kQ8Blobs[k], bytes, [&](std::size_t offset, std::size_t n, const void** out) {
        *out = slice.data();
        return transfer_q8(k, offset, n, slice.data(), false);
      });
      if (!s.ok()) return s;
    }
    return Status::success();
  }

  Status flush() override { return store_.flush(); }

  Status resend_weights(const std::vector<char>* which) override {
    if (!windows_) return StateTier::resend_weights(which);
    return windows_->resend(which);
  }
  Status read_weights16(std::size_t offset, std::size_t n, void* out) override {
    if (!windows_) return StateTier::read_weights16(offset, n, out);
    return windows_->read_weights16(offset, n, out);
  }

  bool in_ram() const override { return false; }

  bool speculates() const override { return true; }

  // Every parameter's segment up front, its gradient (and whether it has one) taken at the gate.
  Status speculate(float grad_scale, const std::vector<ParamGroup>& hyper, const std::vector<char>& left_out,
                   const std::vector<std::size_t>& arrival, const ParamReady& ready) override {
    const std::size_t P = m_.params.size();
    stepped_.assign(P, 0);
    std::vector<char> asked(P, 0);
    std::vector<SwapSegment> segments;
    std::vector<std::size_t> segment_of(P, 0);
    for (std::size_t i = 0; i < P; ++i) {
      const ParamSpec& p = m_.params[i];
      if (p.n == 0 || (!left_out.empty() && left_out[i])) {
        asked[i] = 1;  // no segment: the gate does not wait for it
        continue;
      }
      segment_of[i] = segments.size();
      segments.push_back({at_[i], p.n, &hyper[p.group].hyper, m_.grad_of(i, 0), p.dtype, out_of(i), p.dtype,
                          m_.bias_step(i)});
    }
    const SwapStore::TileGate gate = [&](std::size_t begin, std::size_t end) {
      for (std::size_t i = store_param(begin); i < P && at_[i] < end; ++i) {
        if (m_.params[i].n == 0 || asked[i]) continue;
        asked[i] = 1;
        Result<bool> down = ready(i);
        if (!down.ok()) return down.status();
        SwapSegment& seg = segments[segment_of[i]];
        seg.grad = down.value() ? m_.step_grad(i, 0, &seg.grad_dtype) : nullptr;
        stepped_[i] = down.value() ? 1 : 0;
      }
      return Status::success();
    };
    // A tile is ready once the last of its parameters is: its rank is that parameter's place in the order.
    SwapStore::TileRank rank;
    if (arrival.size() == P) {
      rank = [&](std::size_t begin, std::size_t end) {
        std::size_t last = 0;
        for (std::size_t i = store_param(begin); i < P && at_[i] < end; ++i) {
          if (m_.params[i].n > 0 && (left_out.empty() || !left_out[i])) last = std::max(last, arrival[i]);
        }
        return last;
      };
    }
    StepOptions o;
    o.step = m_.step_count.load() + 1;
    o.grad_scale = grad_scale;
    const Status s = store_.speculate(segments, o, gate, rank);
    add_stats(store_.last_stats());
    return s;
  }

  Status commit_speculation() override {
    const Status s = store_.commit_speculation();
    add_stats(store_.last_stats());  // a resident store writes its tiles here
    return s;
  }

  // The staging's weights the speculation wrote are put back from the masters the store still holds: they
  // are what the device has (each step's weights are its masters, rounded for 16-bit parameters).
  Status discard_speculation() override {
    if (Status s = store_.discard_speculation(); !s.ok()) return s;
    if (Status s = copy_f32_masters(&stepped_); !s.ok()) return s;
    std::vector<float> masters;
    for (std::size_t i = 0; i < m_.params.size(); ++i) {
      if (!stepped_[i] || m_.params[i].dtype == DType::f32) continue;
      const ParamSpec& p = m_.params[i];
      constexpr std::size_t kSlice = std::size_t(1) << 20;
      masters.resize(std::min(kSlice, p.n));
      for (std::size_t b = 0; b < p.n; b += kSlice) {
        const std::size_t n = std::min(kSlice, p.n - b);
        if (Status s = read(m_.offsets[i] + b, n, masters.data(), nullptr, nullptr, nullptr); !s.ok()) return s;
        m_.weights_follow_master(i, b, masters.data(), n);
      }
    }
    std::fill(stepped_.begin(), stepped_.end(), 0);
    return Status::success();
  }

  const std::vector<char>& speculated_params() const override { return stepped_; }

 private:
  bool q8() const { return m_.options.state_dtype == DType::i8; }
  bool q8_blob_kept(int k) const { return zoe::q8_blob_kept(k, m_.two_states()); }
  // Where the step writes parameter i's device weights: the staging (16-bit), or its master's copy (f32).
  void* out_of(std::size_t i) { return m_.params[i].dtype == DType::f32 ? static_cast<void*>(master(i)) : m_.weights_of(i); }
  // The f32 parameters' copies (those marked in `which`, or all) read again from the masters in the store.
  Status copy_f32_masters(const std::vector<char>* which) {
    for (std::size_t i = 0; i < m_.params.size(); ++i) {
      if (m_.params[i].dtype != DType::f32 || m_.params[i].n == 0 || (which != nullptr && !(*which)[i])) continue;
      if (Status s = read(m_.offsets[i], m_.params[i].n, master(i), nullptr, nullptr, nullptr); !s.ok()) return s;
    }
    return Status::success();
  }
  std::size_t blocks() const { return at_.back() / kMomentBlock; }  // i8: every parameter's blocks

  struct Array {
    void* data;  // null: skipped
    std::size_t size;
  };
  using StoreIo = std::function<Status(std::size_t at, std::size_t n, const std::vector<void*>& arrays)>;
  // Flat elements [offset, offset + count) of `arrays`, moved by io() from (or, `in`, to) the store: directly
  // where the store holds them without a gap, else through scratch arrays that span the gaps (zeros going in).
  Status through_gaps(std::size_t offset, std::size_t count, const std::vector<Array>& arrays, bool in, const StoreIo& io) {
    std::vector<void*> direct;
    for (const Array& a : arrays) direct.push_back(a.data);
    if (count == 0) return Status::success();
    const std::size_t first = param_of(offset), last = param_of(offset + count - 1);
    const std::size_t s0 = at_[first] + (offset - m_.offsets[first]);
    const std::size_t s1 = at_[last] + (offset + count - m_.offsets[last]);
    if (s1 - s0 == count) return io(s0, count, direct);
    std::vector<std::vector<unsigned char>> scratch(arrays.size());
    std::vector<void*> staged(arrays.size(), nullptr);
    for (std::size_t k = 0; k < arrays.size(); ++k) {
      if (arrays[k].data == nullptr) continue;
      scratch[k].assign((s1 - s0) * arrays[k].size, 0);
      staged[k] = scratch[k].data();
    }
    auto copy_runs = [&](bool into_scratch) {
      for (std::size_t i = first; i <= last; ++i) {
        const std::size_t lo = std::max(offset, m_.offsets[i]), hi = std::min(offset + count, m_.offsets[i + 1]);
        if (lo >= hi) continue;
        const std::size_t store_at = at_[i] + (lo - m_.offsets[i]) - s0, caller_at = lo - offset;
        for (std::size_t k = 0; k < arrays.size(); ++k) {
          if (arrays[k].data == nullptr) continue;
          unsigned char* a = scratch[k].data() + store_at * arrays[k].size;
          unsigned char* b = static_cast<unsigned char*>(arrays[k].data) + caller_at * arrays[k].size;
          std::memcpy(into_scratch ? a : b, into_scratch ? b : a, (hi - lo) * arrays[k].size);
        }
      }
    };
    if (in) copy_runs(true);
    if (Status s = io(s0, s1 - s0, staged); !s.ok()) return s;
    if (!in) copy_runs(false);
    return Status::success();
  }
  void add_stats(const SwapStats& io) {
    StepStats& st = m_.stats_;
    st.adam_s += io.total_s - io.gate_s;  // a speculation's waits for gradients are backward's time
    st.nvme_read_bytes += io.read_bytes;
    st.nvme_write_bytes += io.write_bytes;
    st.nvme_read_s += io.read_s;
    st.nvme_write_s += io.write_s;
  }
  // The parameter holding store element `at` (the last one starting at or before it).
  std::size_t store_param(std::size_t at) const {
    return static_cast<std::size_t>(std::upper_bound(at_.begin(), at_.end() - 1, at) - at_.begin()) - 1;
  }
  std::size_t param_of(std::size_t flat) const {
    const auto& o = m_.offsets;
    return static_cast<std::size_t>(std::upper_bound(o.begin(), o.end(), flat) - o.begin()) - 1;
  }

  // i8 blob k of kQ8Blobs, bytes [offset, offset + n), out of (or, `in`, into) the store: codes by flat
  // element, scales by block.
  Status transfer_q8(int k, std::size_t offset, std::size_t n, void* data, bool in) {
    if (k >= 2) {
      float* scales = static_cast<float*>(data);
      float* ms = k == 2 ? scales : nullptr;
      float* vs = k == 3 ? scales : nullptr;
      const std::size_t at = offset / 4 * kMomentBlock, count = n / 4 * kMomentBlock;
      return in ? store_.write_q8(at, count, nullptr, nullptr, ms, vs) : store_.read_q8(at, count, nullptr, nullptr, ms, vs);
    }
    return through_gaps(offset, n, {{data, 1}}, in, [&](std::size_t at, std::size_t count, const std::vector<void*>& a) {
      auto* mq = k == 0 ? static_cast<std::int8_t*>(a[0]) : nullptr;
      auto* vq = k == 1 ? static_cast<std::uint8_t*>(a[0]) : nullptr;
      return in ? store_.write_q8(at, count, mq, vq, nullptr, nullptr) : store_.read_q8(at, count, mq, vq, nullptr, nullptr);
    });
  }

  Status load_q8(const CheckpointReader& reader, const std::string& name, int k) {
    const std::size_t bytes = k < 2 ? m_.offsets.back() : blocks() * 4;
    return reader.read_streamed(name, bytes, CheckpointWriter::kStreamSlice,
                                [&](std::size_t offset, const void* data, std::size_t n) {
      return transfer_q8(k, offset, n, const_cast<void*>(data), true);
    });
  }

  // fp32 array k (0 master, then the states: Adam's exp_avg, exp_avg_sq and amsgrad's max) into the store. With i8 moments each block must be encoded
  // once from all its values: a slice is written up to the last block boundary in it, the rest carried over.
  Status load_fp32(const CheckpointReader& reader, const std::string& name, int k) {
    const std::size_t total = m_.offsets.back();
    std::vector<float> carry;
    std::size_t carry_at = 0;  // the flat element of carry[0]
    return reader.read_streamed(name, total * 4, CheckpointWriter::kStreamSlice,
                                [&](std::size_t, const void* data, std::size_t n) {
      const auto* values = static_cast<const float*>(data);
      carry.insert(carry.end(), values, values + n / 4);
      const std::size_t end = carry_at + carry.size();
      std::size_t cut = end;
      if (k > 0 && q8() && end < total) {
        const std::size_t i = param_of(end);
        cut = std::max(carry_at, m_.offsets[i] + (end - m_.offsets[i]) / kMomentBlock * kMomentBlock);
      }
      const float* arrays[4] = {nullptr, nullptr, nullptr, nullptr};
      arrays[k] = carry.data();
      if (Status s = write(carry_at, cut - carry_at, arrays[0], arrays[1], arrays[2], arrays[3]); !s.ok()) return s;
      carry.erase(carry.begin(), carry.begin() + static_cast<std::ptrdiff_t>(cut - carry_at));
      carry_at = cut;
      return Status::success();
    });
  }

  Impl& m_;
  SwapStore store_;
  // Where parameter i's elements start in the store (at_.back(): the store's size): m_.offsets, or with i8
  // moments each parameter rounded up to whole blocks.
  std::vector<std::size_t> at_;
  std::vector<char> stepped_;  // the last speculation's parameters with a gradient (their weights in staging)
  std::unique_ptr<StepWindows> windows_;  // streamed (m_.streamed): the step's windows
  // f32 parameters: the copies of their masters the device receives (master(i)), at f32_at_[i] elements.
  float* f32_copies_ = nullptr;
  std::vector<std::size_t> f32_at_;
};

}  // namespace

// The swap store of tier nvme, for make_nvme_tier and for the footprint checked before it (footprint.h).
NvmeStoreShape nvme_store_shape(const std::vector<ParamSpec>& params, const OffloadOptions& options, std::size_t states) {
  NvmeStoreShape shape;
  SwapOptions& so = shape.options;
  so = SwapOptions::from(options.nvme);
  so.state_dtype = options.state_dtype;  // bf16 moments: slots of 8 bytes per element instead of 12; i8: 6 and scales
  so.state_arrays = states;              // Lion, Adagrad: [p | m], 8 bytes per element in f32
  const bool q8 = so.state_dtype == DType::i8;
  std::vector<std::size_t>& at = shape.at;
  at.assign(params.size() + 1, 0);
  const std::size_t unit = q8 ? kMomentBlock : 1;
  for (std::size_t i = 0; i < params.size(); ++i) at[i + 1] = at[i] + (params[i].n + unit - 1) / unit * unit;
  // Tiles are whole O_DIRECT blocks of fp32 values and, with i8 moments, whole blocks of codes (both powers of two).
  const std::size_t tile_unit = std::max<std::size_t>(std::max<std::size_t>(so.alignment, 4096) / 4, unit);
  shape.tile = (std::max<std::size_t>(options.tile, 1) + tile_unit - 1) / tile_unit * tile_unit;
  return shape;
}

Result<SpaceNeed> nvme_tier_footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options,
                                      const char* name, std::size_t states) {
  NvmeStoreShape shape = nvme_store_shape(params, options, states);
  Result<SpaceNeed> need = SwapStore::footprint(shape.options, name, shape.at.back(), shape.tile);
  if (!need.ok()) return need;
  std::size_t f32 = 0;  // NvmeTier::allocate's copies of the f32 masters
  for (const ParamSpec& p : params) f32 += p.dtype == DType::f32 ? p.n : 0;
  if (f32 > 0) need->add_ram("copies of the fp32 masters", AlignedBuffer::io_size(f32 * 4));
  return need;
}

Result<std::unique_ptr<StateTier>> make_nvme_tier(Impl& m, const char* name) {
  NvmeStoreShape shape = nvme_store_shape(m.params, m.options, m.state_count);
  SwapOptions& so = shape.options;
  so.adam = &m.adam;
  if (Status s = SwapStore::remove(so, name); !s.ok()) return s;
  Result<SwapStore> made = SwapStore::create(so, name, shape.at.back(), shape.tile);
  if (!made.ok()) return made.status();
  auto tier = std::make_unique<NvmeTier>(m, std::move(made).value(), std::move(shape.at));
  if (Status s = tier->allocate(); !s.ok()) return s;
  return std::unique_ptr<StateTier>(std::move(tier));
}
#else
Result<SpaceNeed> nvme_tier_footprint(const std::vector<ParamSpec>&, const OffloadOptions&, const char*, std::size_t) {
  return Status(StatusCode::unsupported, "tier nvme: this build of zoe has no libaio NVMe tier (-Daio=disabled)");
}
Result<std::unique_ptr<StateTier>> make_nvme_tier(Impl&, const char*) {
  return Status(StatusCode::unsupported, "tier nvme: this build of zoe has no libaio NVMe tier (-Daio=disabled)");
}
#endif

}  // namespace zoe
