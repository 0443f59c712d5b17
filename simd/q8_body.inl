// The 8-bit moments' codes (kernels.h): each block decoded, stepped and encoded again with its new scales —
// Adam's two moments here (adam_q8), Lion's one in lion_body.inl (lion_q8) — and the codes' encode and
// decode for taking state in and out. Included after adam_body.inl, whose V operations, staging helpers,
// adam_math and run() it uses.

// Codes [0, count) of one block of one moment into x[] (room for count rounded up to whole vectors): Load
// widens a vector of codes (V::load_i8, m's; V::load_e5m3, v's) and the product with `unit` decodes it.
template <typename Code, typename Load>
inline void decode_codes(const Code* q, float unit, float* x, std::size_t count, Load load) {
  const V::F d = V::set(unit);
  std::size_t i = 0;
  for (; i + V::lanes <= count; i += V::lanes) V::store(x + i, V::mul(load(q + i), d));
  if (i == count) return;
  alignas(64) Code t[V::max_lanes] = {};
  copy_bytes(t, q + i, count - i);
  V::store(x + i, V::mul(load(t), d));
}

// Codes [0, count) of one block into m[] and v[]; v null: m alone (Lion's one moment).
inline void decode_block(const std::int8_t* mq, const std::uint8_t* vq, float m_scale, float v_scale, float* m,
                         float* v, std::size_t count) {
  decode_codes(mq, m_scale / 127.0f, m, count, [](const std::int8_t* q) { return V::load_i8(q); });
  if (v != nullptr) decode_codes(vq, v_scale, v, count, [](const std::uint8_t* q) { return V::load_e5m3(q); });
}

// The largest of `acc`'s lanes and of x[0, count) (|x| when `absolute`); 0 for none. A NaN is never taken
// (the vector max keeps its second operand, the scalar loop compares), so the order changes nothing.
inline float max_of(V::F acc, const float* x, std::size_t count, bool absolute) {
  alignas(64) float lanes[V::max_lanes];
  V::store(lanes, acc);
  float out = 0.0f;
  for (std::size_t k = 0; k < V::lanes; ++k) out = lanes[k] > out ? lanes[k] : out;
  for (std::size_t i = 0; i < count; ++i) {
    const float e = absolute ? __builtin_fabsf(x[i]) : x[i];
    out = e > out ? e : out;
  }
  return out;
}

// Four accumulators: one chain of max would wait on its own latency.
inline float block_max(const float* x, std::size_t count, bool absolute) {
  V::F acc0 = V::set(0.0f), acc1 = V::set(0.0f), acc2 = V::set(0.0f), acc3 = V::set(0.0f);
  auto at = [&](std::size_t i) { return absolute ? V::abs(V::load(x + i)) : V::load(x + i); };
  std::size_t i = 0;
  for (; i + 4 * V::lanes <= count; i += 4 * V::lanes) {
    acc0 = V::max(at(i), acc0);
    acc1 = V::max(at(i + V::lanes), acc1);
    acc2 = V::max(at(i + 2 * V::lanes), acc2);
    acc3 = V::max(at(i + 3 * V::lanes), acc3);
  }
  for (; i + V::lanes <= count; i += V::lanes) acc0 = V::max(at(i), acc0);
  return max_of(V::max(V::max(acc0, acc1), V::max(acc2, acc3)), x + i, count - i, absolute);
}

// fp32 x[] of one block of one moment (room for whole vectors) to codes: Store encodes a vector already
// multiplied by `unit` (V::store_i8, m's; V::store_e5m3, v's).
template <typename Code, typename Store>
inline void encode_codes(const float* x, std::size_t count, float unit, Code* q, Store store) {
  const V::F u = V::set(unit);
  std::size_t i = 0;
  for (; i + V::lanes <= count; i += V::lanes) store(q + i, V::mul(V::load(x + i), u));
  if (i == count) return;
  alignas(64) float t[V::max_lanes] = {};
  alignas(64) Code c[V::max_lanes];
  copy_bytes(t, x + i, (count - i) * 4);
  store(c, V::mul(V::load(t), u));
  copy_bytes(q + i, c, count - i);
}

// m[] to codes with the block's scale ms = max |m|.
inline void encode_m(const float* m, std::size_t count, float ms, std::int8_t* mq) {
  encode_codes(m, count, ms > 0.0f ? 127.0f / ms : 0.0f, mq, [](std::int8_t* q, V::F x) { V::store_i8(q, x); });
}

// fp32 m[] and v[] of one block (room for whole vectors) to codes with the block's scales ms = max |m|,
// vs = max v.
inline void encode_with(const float* m, const float* v, std::size_t count, float ms, float vs, std::int8_t* mq,
                        std::uint8_t* vq) {
  encode_m(m, count, ms, mq);
  encode_codes(v, count, vs > 0.0f ? 1.0f / vs : 0.0f, vq, [](std::uint8_t* q, V::F x) { V::store_e5m3(q, x); });
}

// v null: m alone (Lion's one moment), v_scale not written.
inline void encode_block(const float* m, const float* v, std::size_t count, std::int8_t* mq, std::uint8_t* vq,
                         float* m_scale, float* v_scale) {
  *m_scale = block_max(m, count, true);
  if (v == nullptr) {
    encode_m(m, count, *m_scale, mq);
    return;
  }
  *v_scale = block_max(v, count, false);
  encode_with(m, v, count, *m_scale, *v_scale, mq, vq);
}

// One block in one pass: its codes decoded in registers, stepped by adam_math, the new fp32 moments kept in
// tm/tv (L1) with their running maxima; then encoded with the new scales. The last block's tail is staged
// through zero-padded lane buffers, as run() stages it; only its real elements count toward the maxima.
// Read from `in` (its p, codes and scales), written to p, mq, vq, m_scale, v_scale: the codes are encoded
// only after the whole block was read, so in place is one case of it.
template <int G, int O, bool L2>
inline void adam_q8_block(const Broadcast& b, const StateIn& in, float* p, std::int8_t* mq, std::uint8_t* vq,
                          float* m_scale, float* v_scale, const void* g, void* out, std::size_t count, float* tm,
                          float* tv) {
  const V::F dm = V::set(*in.m_scale / 127.0f), dv = V::set(*in.v_scale);
  const auto* mq_in = static_cast<const std::int8_t*>(in.m);
  const auto* vq_in = static_cast<const std::uint8_t*>(in.v);
  V::F mmax = V::set(0.0f), vmax = V::set(0.0f);
  V::F mv, vv;
  auto lanes = [&](const float* p_in, float* pp, const std::int8_t* mc, const std::uint8_t* vc, const void* gg,
                   void* oo, std::size_t i, float* m_out, float* v_out) {
    V::F pv = V::load(p_in + i);
    mv = V::mul(V::load_i8(mc + i), dm);
    vv = V::mul(V::load_e5m3(vc + i), dv);
    adam_math<L2>(b, load_grad<G>(gg, i), pv, mv, vv);
    V::store(pp + i, pv);
    V::store(m_out, mv);
    V::store(v_out, vv);
    store_out<O>(oo, i, pv);
  };
  std::size_t i = 0;
  for (; i + V::lanes <= count; i += V::lanes) {
    lanes(in.p, p, mq_in, vq_in, g, out, i, tm + i, tv + i);
    mmax = V::max(V::abs(mv), mmax);
    vmax = V::max(vv, vmax);
  }
  const std::size_t tail = count - i;
  if (tail > 0) {
    alignas(64) float sp[V::max_lanes] = {};
    alignas(64) std::int8_t sm[V::max_lanes] = {};
    alignas(64) std::uint8_t sv[V::max_lanes] = {};
    alignas(64) unsigned char sg[V::max_lanes * 4] = {};
    alignas(64) std::uint16_t so[V::max_lanes] = {};
    copy_bytes(sp, in.p + i, tail * 4);
    copy_bytes(sm, mq_in + i, tail);
    copy_bytes(sv, vq_in + i, tail);
    copy_bytes(sg, static_cast<const unsigned char*>(g) + i * elem_bytes(G), tail * elem_bytes(G));
    lanes(sp, sp, sm, sv, sg, so, 0, tm + i, tv + i);
    copy_bytes(p + i, sp, tail * 4);
    if constexpr (O != kOutNone) copy_bytes(static_cast<unsigned char*>(out) + i * out_bytes(O), so, tail * out_bytes(O));
  }
  *m_scale = max_of(mmax, tm + i, tail, true);
  *v_scale = max_of(vmax, tv + i, tail, false);
  encode_with(tm, tv, count, *m_scale, *v_scale, mq, vq);
}

template <int G, int O>
void adam_q8(const AdamConstants& c, const StateIn& in, float* p, std::int8_t* m, std::uint8_t* v, float* m_scale,
             float* v_scale, const void* g, void* out, std::size_t n) {
  // Room for a whole last vector: a short block's tail is written there as a full vector.
  alignas(64) float tm[kQuantBlock + V::max_lanes], tv[kQuantBlock + V::max_lanes];
  const Broadcast b(c);
  for (std::size_t start = 0, j = 0; start < n; start += kQuantBlock, ++j) {
    const std::size_t count = n - start < kQuantBlock ? n - start : kQuantBlock;
    const void* gj = static_cast<const unsigned char*>(g) + start * elem_bytes(G);
    void* oj = O == kOutNone ? nullptr : static_cast<unsigned char*>(out) + start * out_bytes(O);
    const StateIn block{in.p + start, static_cast<const std::int8_t*>(in.m) + start,
                        static_cast<const std::uint8_t*>(in.v) + start, in.m_scale + j, in.v_scale + j};
    if (c.l2 != 0.0f) {  // as adam(): AdamW and weight_decay = 0 never compute 0 * p
      adam_q8_block<G, O, true>(b, block, p + start, m + start, v + start, m_scale + j, v_scale + j, gj, oj, count,
                                tm, tv);
    } else {
      adam_q8_block<G, O, false>(b, block, p + start, m + start, v + start, m_scale + j, v_scale + j, gj, oj, count,
                                 tm, tv);
    }
  }
}

template <int G, int O>
void streams_q8(const AdamConstants& c, const StateIn& in, float* p, std::int8_t* m, std::uint8_t* v, float*, float*,
                const void* g, void* out, std::size_t n) {
  run<G, O, kStateInt8, false, StreamsLanes>(c, in, p, m, v, g, out, n);
}

// v null (Lion's one moment): m's codes and scales alone; vq and v_scale are not touched.
void encode_q8(const float* m, const float* v, std::size_t n, std::int8_t* mq, std::uint8_t* vq, float* m_scale,
               float* v_scale) {
  alignas(64) float tm[kQuantBlock], tv[kQuantBlock];
  for (std::size_t start = 0, j = 0; start < n; start += kQuantBlock, ++j) {
    const std::size_t count = n - start < kQuantBlock ? n - start : kQuantBlock;
    copy_bytes(tm, m + start, count * 4);
    if (v == nullptr) {
      encode_block(tm, nullptr, count, mq + start, nullptr, &m_scale[j], nullptr);
      continue;
    }
    copy_bytes(tv, v + start, count * 4);
    encode_block(tm, tv, count, mq + start, vq + start, &m_scale[j], &v_scale[j]);
  }
}

void decode_q8(const std::int8_t* mq, const std::uint8_t* vq, const float* m_scale, const float* v_scale,
               std::size_t n, float* m, float* v) {
  alignas(64) float tm[kQuantBlock], tv[kQuantBlock];
  for (std::size_t start = 0, j = 0; start < n; start += kQuantBlock, ++j) {
    const std::size_t count = n - start < kQuantBlock ? n - start : kQuantBlock;
    decode_block(mq + start, v == nullptr ? nullptr : vq + start, m_scale[j], v == nullptr ? 0.0f : v_scale[j], tm,
                 v == nullptr ? nullptr : tv, count);
    copy_bytes(m + start, tm, count * 4);
    if (v != nullptr) copy_bytes(v + start, tv, count * 4);
  }
}
