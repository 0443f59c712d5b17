// Tier ram: the fp32 master weights and the rule's state arrays (fp32, bf16 or i8, OffloadOptions::state_dtype)
// of the flattened parameters in host arrays: Adam's moments m and v (and with amsgrad vmax, v's running
// maximum), Lion's m, Adagrad's sum (kept as m). i8 (Adam) adds two arrays of block scales, each parameter's
// blocks counted from its first element. With the overlap schedule a second set of the same arrays holds what
// the speculative steps write (ping-pong): each parameter's state is in the set Impl::set_of names.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "src/offload/checkpoint.h"
#include "src/offload/footprint.h"
#include "src/offload/optimizer_impl.h"
#include "zoe/aligned_buffer.h"

namespace zoe {
namespace {

class RamTier final : public StateTier {
 public:
  explicit RamTier(Impl& m) : m_(m) {}

  Status allocate() {
    scale_offsets_.assign(m_.params.size() + 1, 0);
    for (std::size_t i = 0; i < m_.params.size(); ++i) scale_offsets_[i + 1] = scale_offsets_[i] + moment_blocks(m_.params[i].n);
    return allocate_set(sets_[0], false);
  }

  // The second set starts as zeros too: a step aside writes every byte it later reads of it.
  Status allocate_second_set() override { return allocate_set(sets_[1], true); }

  Status initialize() override {
    for (std::size_t i = 0; i < m_.params.size(); ++i) {
      const ParamSpec& p = m_.params[i];
      if (p.dtype == DType::f32) continue;
      const auto* w = static_cast<const std::uint16_t*>(m_.weights_of(i));
      float* dst = m_.master_of(i);
      for (std::size_t k = 0; k < p.n; ++k) dst[k] = p.dtype == DType::f16 ? f16_to_float(w[k]) : bf16_to_float(w[k]);
    }
    return Status::success();
  }

  // One CpuAdam call per param group and step count over the given pieces (a multi-tensor step) with the
  // group's rule; pieces of parameters without a gradient this iteration are left as they are.
  Status step(const std::vector<std::size_t>& which, float grad_scale, int set,
              const std::vector<ParamGroup>& hyper, bool aside) override {
    if (aside && sets_[1].master.data() == nullptr && m_.offsets.back() > 0) {
      return Status(StatusCode::internal, "a step aside without a second state set (allocate_second_set)");
    }
    const auto start = std::chrono::steady_clock::now();
    struct Call {
      std::size_t group;
      std::int64_t step;
      std::vector<AdamTensor> tensors;          // Adam
      std::vector<OneStateTensor> one_state;    // Lion, Adagrad
    };
    std::vector<Call> calls;  // parameters usually share one step count: one call per group
    for (std::size_t k : which) {
      const std::size_t i = m_.pieces[k].param;
      if (m_.is_absent(i, set)) continue;
      const std::size_t g = static_cast<std::size_t>(m_.params[i].group);
      const std::int64_t t = m_.bias_step(i);
      auto c = std::find_if(calls.begin(), calls.end(), [&](const Call& x) { return x.group == g && x.step == t; });
      if (c == calls.end()) c = calls.insert(calls.end(), Call{g, t, {}, {}});
      if (m_.two_states()) {
        c->tensors.push_back(tensor(m_.pieces[k], set, aside));
      } else {
        c->one_state.push_back(one_state_of(tensor(m_.pieces[k], set, aside)));
      }
    }
    std::sort(calls.begin(), calls.end(), [](const Call& a, const Call& b) { return a.group < b.group; });
    for (const Call& c : calls) {
      StepOptions o;
      o.step = c.step;
      o.grad_scale = grad_scale;
      if (Status s = step_rule(m_.adam, hyper[c.group].hyper, o, c.tensors, c.one_state); !s.ok()) return s;
    }
    m_.stats_.adam_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return Status::success();
  }

  Status read(std::size_t offset, std::size_t count, float* p, float* m, float* v, float* vmax) override {
    if (q8()) {
      if (m != nullptr || v != nullptr) q8_blocks(offset, count, m, v, false);
    }
    // Parameter by parameter: each one's current set; in place, an f32 parameter's master is on the device.
    for_each_param(offset, count, [&](std::size_t i, std::size_t at, std::size_t n, std::size_t done) {
      if (!q8()) {
        if (m != nullptr) moments_out(moment_at(i, 1, set_of(i)) + at * m_.moment_bytes(), n, m + done);
        if (v != nullptr) moments_out(moment_at(i, 2, set_of(i)) + at * m_.moment_bytes(), n, v + done);
        if (vmax != nullptr) moments_out(moment_at(i, 3, set_of(i)) + at * m_.moment_bytes(), n, vmax + done);
      }
      if (p != nullptr) std::memcpy(p + done, m_.master_of(i) + at, n * 4);
    });
    return Status::success();
  }

  // A single parameter's range (write_state), so the master is its own.
  Status write(std::size_t offset, std::size_t count, const float* p, const float* m, const float* v,
               const float* vmax) override {
    if (q8()) {
      if (m != nullptr || v != nullptr) q8_blocks(offset, count, const_cast<float*>(m), const_cast<float*>(v), true);
    }
    for_each_param(offset, count, [&](std::size_t i, std::size_t at, std::size_t n, std::size_t done) {
      if (!q8()) {
        if (m != nullptr) moments_in(m + done, n, moment_at(i, 1, set_of(i)) + at * m_.moment_bytes());
        if (v != nullptr) moments_in(v + done, n, moment_at(i, 2, set_of(i)) + at * m_.moment_bytes());
        if (vmax != nullptr) moments_in(vmax + done, n, moment_at(i, 3, set_of(i)) + at * m_.moment_bytes());
      }
      if (p != nullptr) std::memcpy(m_.master_of(i) + at, p + done, n * 4);
    });
    return Status::success();
  }

  // Read whole into new arrays first: a corrupt checkpoint leaves the state as it was. The loaded state is
  // the first set's, current for every parameter (the caller puts the weights in the first set too).
  Status load(const CheckpointReader& reader, const std::string&, std::int64_t) override {
    const std::size_t total = m_.offsets.back();
    const int arrays = 1 + static_cast<int>(m_.state_count);
    AlignedBuffer loaded[4];
    for (int k = 0; k < arrays; ++k) {
      Result<AlignedBuffer> b = AlignedBuffer::allocate(total * 4);
      if (!b.ok()) return b.status();
      loaded[k] = std::move(b).value();
      if (Status s = reader.read(m_.state_blob(k), loaded[k].data(), total * 4); !s.ok()) return s;
    }
    if (q8()) {
      if (Status s = load_q8(reader, loaded); !s.ok()) return s;
      std::fill(m_.current_set.begin(), m_.current_set.end(), 0);
      return Status::success();
    }
    // Checkpoints hold fp32 moments: bf16 ones are rounded from them here (exact for a bf16 run's own).
    for (int k = 1; k < arrays && m_.options.state_dtype != DType::f32; ++k) {
      Result<AlignedBuffer> b = AlignedBuffer::allocate(total * 2);
      if (!b.ok()) return b.status();
      AlignedBuffer narrow = std::move(b).value();
      moments_in(loaded[k].as<float>(), total, narrow.as<unsigned char>());
      loaded[k] = std::move(narrow);
    }
    // Into the arrays in place, which keeps the first set's pages where they are.
    AlignedBuffer* into[4] = {&sets_[0].master, &sets_[0].exp_avg, &sets_[0].exp_avg_sq, &sets_[0].max_sq};
    for (int k = 0; k < arrays; ++k) {
      if (k == 0 && m_.in_place) {
        *into[k] = std::move(loaded[k]);  // read by the in-place load from master(i), never handed out
      } else if (total > 0) {
        std::memcpy(into[k]->data(), loaded[k].data(), total * (k == 0 ? 4 : m_.moment_bytes()));
      }
    }
    std::fill(m_.current_set.begin(), m_.current_set.end(), 0);
    return Status::success();
  }

  bool in_ram() const override { return true; }

  PieceState piece(const Piece& k) override { return piece_in(k, set_of(k.param), false); }
  // The other set; an f32 parameter's master in place goes to the second set's (master_aside).
  PieceState piece_aside(const Piece& k) override { return piece_in(k, 1 - set_of(k.param), true); }

  // The codes and scales of the current sets, gathered parameter by parameter into one flat array each.
  Status save_q8(CheckpointWriter& writer) override {
    if (!q8()) return Status::success();
    const std::size_t total = m_.offsets.back(), scales = scale_offsets_.back() * 4;
    if (std::find(m_.current_set.begin(), m_.current_set.end(), 1) == m_.current_set.end()) {
      const AlignedBuffer* arrays[4] = {&sets_[0].exp_avg, &sets_[0].exp_avg_sq, &sets_[0].m_scale, &sets_[0].v_scale};
      for (int k = 0; k < 4; ++k) {
        if (!q8_blob_kept(k)) continue;
        if (Status s = writer.add(kQ8Blobs[k], arrays[k]->data(), k < 2 ? total : scales); !s.ok()) return s;
      }
      return Status::success();
    }
    for (int k = 0; k < 4; ++k) {
      if (!q8_blob_kept(k)) continue;
      const bool codes = k < 2;
      Result<AlignedBuffer> b = AlignedBuffer::allocate(codes ? total : scales);
      if (!b.ok()) return b.status();
      AlignedBuffer flat_copy = std::move(b).value();
      for (std::size_t i = 0; i < m_.params.size(); ++i) {
        const Set& st = sets_[set_of(i)];
        const std::size_t at = codes ? m_.offsets[i] : scale_offsets_[i] * 4;
        const std::size_t bytes = codes ? m_.params[i].n : moment_blocks(m_.params[i].n) * 4;
        const AlignedBuffer& from = k == 0 ? st.exp_avg : k == 1 ? st.exp_avg_sq : k == 2 ? st.m_scale : st.v_scale;
        if (bytes > 0) std::memcpy(flat_copy.as<unsigned char>() + at, from.as<unsigned char>() + at, bytes);
      }
      if (Status s = writer.add(kQ8Blobs[k], flat_copy.data(), codes ? total : scales); !s.ok()) return s;
    }
    return Status::success();
  }

  // Contiguous only while every parameter's state is in the first set; save() otherwise reads it through read().
  const float* flat(int which) const override {
    if (std::find(m_.current_set.begin(), m_.current_set.end(), 1) != m_.current_set.end()) return nullptr;
    if (which == 0) return m_.in_place ? nullptr : sets_[0].master.as<float>();
    if (m_.options.state_dtype != DType::f32 || which > static_cast<int>(m_.state_count)) return nullptr;
    return array(sets_[0], which).as<float>();
  }

  float* moments(std::size_t i, int which) override {
    if (m_.options.state_dtype != DType::f32 || which > static_cast<int>(m_.state_count)) return nullptr;
    return reinterpret_cast<float*>(moment_at(i, which, set_of(i)));
  }

  float* master(std::size_t i) override { return sets_[set_of(i)].master.as<float>() + m_.offsets[i]; }
  float* master_aside(std::size_t i) override {
    const bool device_master = m_.in_place && m_.params[i].dtype == DType::f32;
    return sets_[device_master ? 1 : 1 - set_of(i)].master.as<float>() + m_.offsets[i];
  }

 private:
  struct Set {
    AlignedBuffer master, exp_avg, exp_avg_sq;
    AlignedBuffer max_sq;            // amsgrad: max_exp_avg_sq
    AlignedBuffer m_scale, v_scale;  // i8: the block scales
  };
  // State array `which` (1 m, 2 v, 3 vmax) of a set.
  static const AlignedBuffer& array(const Set& st, int which) {
    return which == 1 ? st.exp_avg : which == 2 ? st.exp_avg_sq : st.max_sq;
  }

  Status allocate_set(Set& st, bool second) {
    const std::size_t total = m_.offsets.back();
    for (AlignedBuffer* b : {&st.master, &st.exp_avg, &st.exp_avg_sq, &st.max_sq}) {
      // Lion and Adagrad keep one state array; only amsgrad keeps a third.
      if ((b == &st.exp_avg_sq && !m_.two_states()) || (b == &st.max_sq && m_.state_count < 3)) continue;
      const std::size_t bytes = total * (b == &st.master ? 4 : m_.moment_bytes());
      Result<AlignedBuffer> r = AlignedBuffer::allocate(bytes);
      if (!r.ok()) return r.status();
      *b = std::move(r).value();
      // In place, f32 parameters keep their master on the device: their part of the first set's master is
      // never touched (glibc maps large allocations lazily, so untouched pages cost no memory); the rest is
      // written at start-up. All-zero bytes are +0 in fp32 and bf16 alike.
      if (total > 0 && !(m_.in_place && !second && b == &st.master)) std::memset(b->data(), 0, bytes);
    }
    if (!q8()) return Status::success();
    for (AlignedBuffer* b : {&st.m_scale, &st.v_scale}) {
      if (b == &st.v_scale && !m_.two_states()) continue;  // Lion: one moment, one scale per block
      Result<AlignedBuffer> r = AlignedBuffer::allocate(scale_offsets_.back() * 4);
      if (!r.ok()) return r.status();
      *b = std::move(r).value();
      if (scale_offsets_.back() > 0) std::memset(b->data(), 0, scale_offsets_.back() * 4);  // zero codes, scales: m = v = 0
    }
    return Status::success();
  }

  int set_of(std::size_t i) const { return m_.set_of(i); }

  // Parameter i's exp_avg (1), exp_avg_sq (2) or max_exp_avg_sq (3) in set `s`, from its first element.
  unsigned char* moment_at(std::size_t i, int which, int s) {
    return array(sets_[s], which).as<unsigned char>() + m_.offsets[i] * m_.moment_bytes();
  }

  // Piece k's state in set `s` (its current one, or the other: `aside`), the master where master_of or
  // master_aside puts it.
  PieceState piece_in(const Piece& k, int s, bool aside) {
    const std::size_t off = (m_.offsets[k.param] + k.begin) * m_.moment_bytes();
    float* p = aside ? master_aside(k.param) : m_.master_of(k.param);
    unsigned char* v = m_.two_states() ? sets_[s].exp_avg_sq.as<unsigned char>() + off : nullptr;
    PieceState st{p + k.begin, sets_[s].exp_avg.as<unsigned char>() + off, v};
    if (m_.state_count > 2) st.vmax = sets_[s].max_sq.as<unsigned char>() + off;
    if (q8()) {
      st.scale_index = scale_offsets_[k.param] + k.begin / kMomentBlock;
      st.m_scale = sets_[s].m_scale.as<float>() + st.scale_index;
      if (m_.two_states()) st.v_scale = sets_[s].v_scale.as<float>() + st.scale_index;
    }
    return st;
  }

  // Piece k as a tensor of CpuAdam: stepped in its current set, or (aside) from it into the other set, with
  // the 16-bit weights written where Impl::weights_aside says.
  AdamTensor tensor(const Piece& k, int set, bool aside) {
    const ParamSpec& p = m_.params[k.param];
    const PieceState st = aside ? piece_aside(k) : piece(k);
    AdamTensor t;
    t.param = st.p;
    t.exp_avg = st.m;
    t.exp_avg_sq = st.v;
    t.state_dtype = m_.options.state_dtype;
    t.exp_avg_scale = st.m_scale;
    t.exp_avg_sq_scale = st.v_scale;
    if (aside) {
      const PieceState cur = piece(k);
      t.from = AdamSource{cur.p, cur.m, cur.v, cur.m_scale, cur.v_scale, cur.vmax};
    }
    t.max_exp_avg_sq = st.vmax;
    t.grad = static_cast<const unsigned char*>(m_.step_grad(k.param, set, &t.grad_dtype)) + k.begin * dtype_size(t.grad_dtype);
    void* weights = p.dtype == DType::f32 ? nullptr : aside ? m_.weights_aside(k.param) : m_.weights_of(k.param);
    t.out = weights == nullptr ? nullptr : static_cast<unsigned char*>(weights) + k.begin * 2;
    t.out_dtype = p.dtype == DType::f32 ? DType::bf16 : p.dtype;
    t.n = k.n;
    return t;
  }

  // Calls f(param, first element in it, count, elements done before it) over the flat range
  // [offset, offset + count), parameter by parameter.
  template <typename F>
  void for_each_param(std::size_t offset, std::size_t count, F f) {
    const std::vector<std::size_t>& offsets = m_.offsets;
    std::size_t i = static_cast<std::size_t>(std::upper_bound(offsets.begin(), offsets.end(), offset) - offsets.begin()) - 1;
    for (std::size_t done = 0; done < count; ++i) {
      const std::size_t at = offset + done - offsets[i], n = std::min(count - done, m_.params[i].n - at);
      f(i, at, n, done);
      done += n;
    }
  }

  // `count` moments (fp32 or bf16 bytes at `src`) widened to fp32 into `out`, and fp32 values stored into them.
  void moments_out(const unsigned char* src, std::size_t count, float* out) const {
    if (m_.options.state_dtype == DType::f32) {
      std::memcpy(out, src, count * 4);
      return;
    }
    const auto* s16 = reinterpret_cast<const std::uint16_t*>(src);
    for (std::size_t k = 0; k < count; ++k) out[k] = bf16_to_float(s16[k]);
  }
  void moments_in(const float* in, std::size_t count, unsigned char* dst) const {
    if (m_.options.state_dtype == DType::f32) {
      std::memcpy(dst, in, count * 4);
      return;
    }
    auto* d16 = reinterpret_cast<std::uint16_t*>(dst);
    for (std::size_t k = 0; k < count; ++k) d16[k] = float_to_bf16(in[k]);
  }

  bool q8() const { return m_.options.state_dtype == DType::i8; }
  bool q8_blob_kept(int k) const { return zoe::q8_blob_kept(k, m_.two_states()); }

  // 8-bit moments [offset, offset + count) (flat elements) out to fp32 arrays, or in from them (`in`): block by
  // block of each parameter in its current set, decoded, and for `in` the covered part replaced (a null array
  // keeps its moment) and encoded again with new scales.
  void q8_blocks(std::size_t offset, std::size_t count, float* m, float* v, bool in) {
    const std::vector<std::size_t>& offsets = m_.offsets;
    std::vector<float> tm(kMomentBlock), tv(kMomentBlock);
    std::size_t i = static_cast<std::size_t>(std::upper_bound(offsets.begin(), offsets.end(), offset) - offsets.begin()) - 1;
    for (; i < m_.params.size() && offsets[i] < offset + count; ++i) {
      Set& st = sets_[set_of(i)];
      auto* mq = st.exp_avg.as<std::int8_t>();
      auto* vq = m_.two_states() ? st.exp_avg_sq.as<std::uint8_t>() : nullptr;  // Lion: m alone
      const std::size_t a = std::max(offset, offsets[i]) - offsets[i];
      const std::size_t z = std::min(offset + count, offsets[i + 1]) - offsets[i];
      for (std::size_t j = a / kMomentBlock; j * kMomentBlock < z; ++j) {
        const std::size_t start = j * kMomentBlock, nb = std::min(kMomentBlock, m_.params[i].n - start);
        const std::size_t at = offsets[i] + start, scale = scale_offsets_[i] + j;
        float* ms = st.m_scale.as<float>() + scale;
        float* vs = vq == nullptr ? nullptr : st.v_scale.as<float>() + scale;
        float* tvs = vq == nullptr ? nullptr : tv.data();
        decode_moments(mq + at, vq == nullptr ? nullptr : vq + at, ms, vs, nb, tm.data(), tvs);
        const std::size_t lo = std::max(a, start), hi = std::min(z, start + nb);  // within the parameter
        for (std::size_t x = lo; x < hi; ++x) {
          const std::size_t outside = offsets[i] + x - offset;
          if (in) {
            if (m != nullptr) tm[x - start] = m[outside];
            if (v != nullptr) tv[x - start] = v[outside];
          } else {
            if (m != nullptr) m[outside] = tm[x - start];
            if (v != nullptr) v[outside] = tv[x - start];
          }
        }
        if (in) encode_moments(tm.data(), tvs, nb, mq + at, vq == nullptr ? nullptr : vq + at, ms, vs);
      }
    }
  }

  // A checkpoint of an i8 run holds its codes and scales: taken as they are, so that a resumed run continues
  // bit for bit. Otherwise (fp32 or bf16 moments) the fp32 moments are encoded. New arrays first: a corrupt
  // checkpoint leaves the state as it was.
  Status load_q8(const CheckpointReader& reader, AlignedBuffer (&loaded)[4]) {
    const std::size_t total = m_.offsets.back(), scales = scale_offsets_.back() * 4;
    AlignedBuffer codes[2], scale[2];
    AlignedBuffer* dst[4] = {&codes[0], &codes[1], &scale[0], &scale[1]};
    for (int k = 0; k < 4; ++k) {
      if (!q8_blob_kept(k)) continue;
      Result<AlignedBuffer> r = AlignedBuffer::allocate(k < 2 ? total : scales);
      if (!r.ok()) return r.status();
      *dst[k] = std::move(r).value();
    }
    if (reader.has(kQ8Blobs[0])) {
      for (int k = 0; k < 4; ++k) {
        if (!q8_blob_kept(k)) continue;
        if (Status s = reader.read(kQ8Blobs[k], dst[k]->data(), k < 2 ? total : scales); !s.ok()) return s;
      }
    } else {
      const bool two = m_.two_states();
      for (std::size_t i = 0; i < m_.params.size(); ++i) {
        const std::size_t at = m_.offsets[i], sc = scale_offsets_[i];
        encode_moments(loaded[1].as<float>() + at, two ? loaded[2].as<float>() + at : nullptr, m_.params[i].n,
                       codes[0].as<std::int8_t>() + at, two ? codes[1].as<std::uint8_t>() + at : nullptr,
                       scale[0].as<float>() + sc, two ? scale[1].as<float>() + sc : nullptr);
      }
    }
    sets_[0].master = std::move(loaded[0]);
    sets_[0].exp_avg = std::move(codes[0]);
    sets_[0].exp_avg_sq = std::move(codes[1]);
    sets_[0].m_scale = std::move(scale[0]);
    sets_[0].v_scale = std::move(scale[1]);
    return Status::success();
  }

  Impl& m_;
  std::vector<std::size_t> scale_offsets_;  // i8: each parameter's first block in a set's m_scale / v_scale
  Set sets_[2];  // the second allocated only for steps aside (allocate_second_set)
};

}  // namespace

// RamTier::allocate's arrays. In place, an f32 parameter's part of the master is allocated but never touched
// (its master is the device's weights), so it takes no memory and is not counted.
SpaceNeed ram_tier_footprint(const std::vector<ParamSpec>& params, const OffloadOptions& options, bool in_place,
                             std::size_t states) {
  std::size_t total = 0, untouched = 0, blocks = 0;
  for (const ParamSpec& p : params) {
    total += p.n;
    untouched += in_place && p.dtype == DType::f32 ? p.n : 0;
    blocks += moment_blocks(p.n);
  }
  SpaceNeed need;
  need.add_ram("fp32 master weights", AlignedBuffer::size_for((total - untouched) * 4));
  need.add_ram("moments", states * AlignedBuffer::size_for(total * dtype_size(options.state_dtype)));
  // i8: a scale per block and moment (Adam's two, Lion's one).
  if (options.state_dtype == DType::i8) need.add_ram("moments", states * AlignedBuffer::size_for(blocks * 4));
  return need;
}

Result<std::unique_ptr<StateTier>> make_ram_tier(Impl& m) {
  auto tier = std::make_unique<RamTier>(m);
  if (Status s = tier->allocate(); !s.ok()) return s;
  return std::unique_ptr<StateTier>(std::move(tier));
}

}  // namespace zoe
