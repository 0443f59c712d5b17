// The Adam kernels, written once over a vector-ops struct `V` that each ISA translation unit defines before
// including this file inside its own namespace (zoe::simd::<isa>), so template instances never mix ISAs.
//
// V provides: type F; lanes, the fp32 lanes of F (a std::size_t constant, or for SVE an object that converts to
// the count the CPU has, read at run time); constexpr std::size_t max_lanes >= lanes (the stack buffers' size);
// F set(float); F load(const float*); void store(float*, F);
// F load_f16(const std::uint16_t*); F load_bf16(const std::uint16_t*); void store_f16(std::uint16_t*, F);
// void store_bf16(std::uint16_t*, F); F add(F, F); F sub(F, F); F mul(F, F); F div(F, F); F sqrt(F);
// F fma(F a, F b, F c) = a * b + c; for 8-bit moments F abs(F); F max(F, F) (x86 maxps: the second operand
// when either is NaN); F load_i8(const std::int8_t*), void store_i8(std::int8_t*, F) (round to nearest even,
// saturated); F load_e5m3(const std::uint8_t*), void store_e5m3(std::uint8_t*, F) (kernels.h's v code);
// for Lion F sign(F) = (x > 0) - (x < 0) as torch.sign: +1, -1, or +0 for +-0 and NaN.
//
// F may be sizeless (SVE's svfloat32_t): the body keeps vectors only in locals, parameters and references,
// never in struct members or arrays (docs/architecture.md, "Kernels and ISAs").
// Optional in V: void stream(float*, F), a store that bypasses the cache (its pointer aligned to a whole
// vector), and void stream_fence(), which orders such stores before every later one. A step out of place
// writes its fp32 state with them: a plain store to a line not in cache first reads it (12 more bytes per
// element for p, m and v, which a step in place has just read anyway), and the set written is read again
// only at the next step, from memory.
//
// Also the gradient-accumulation kernels (acc += g over micro-batches), below the Adam ones. The other rules
// (Lion, Adagrad, AMSGrad) run through rule_run.inl; kernel_bodies.inl includes them all in order.
//
// Every element goes through the same vector code, the tail included (it is staged through a lane-sized
// buffer), so results are bit-identical whatever the split of a tensor into calls.
//
// The Adam kernels read the state from one set of arrays (p_in, m_in, v_in) and write it to another (p, m,
// v): the same arrays to step in place, or disjoint ones to leave what was read as it was (kernels.h). An
// element's loads come before its stores, so in place is one case of out of place.

template <int G>
inline V::F load_grad(const void* g, std::size_t i) {
  if constexpr (G == kF32) return V::load(static_cast<const float*>(g) + i);
  if constexpr (G == kF16) return V::load_f16(static_cast<const std::uint16_t*>(g) + i);
  if constexpr (G == kBF16) return V::load_bf16(static_cast<const std::uint16_t*>(g) + i);
}

// One gradient value widened to float, without vectors: for tails and exact re-sums.
template <int G>
inline float scalar_grad(const void* g, std::size_t i) {
  if constexpr (G == kF32) return static_cast<const float*>(g)[i];
  if constexpr (G == kF16) return f16_to_f32(static_cast<const std::uint16_t*>(g)[i]);
  if constexpr (G == kBF16) return bf16_to_f32(static_cast<const std::uint16_t*>(g)[i]);
}

template <int O>
inline void store_out(void* out, std::size_t i, V::F x) {
  if constexpr (O == kOutF16) V::store_f16(static_cast<std::uint16_t*>(out) + i, x);
  if constexpr (O == kOutBF16) V::store_bf16(static_cast<std::uint16_t*>(out) + i, x);
}

constexpr std::size_t elem_bytes(int elem) { return elem == kF32 ? 4 : 2; }
constexpr std::size_t out_bytes(int out) { return out == kOutNone ? 0 : 2; }
constexpr std::size_t state_bytes(int state) { return state == kStateF32 ? 4 : state == kStateBF16 ? 2 : 1; }

// kStateInt8 here is only the streams ceiling's view of the codes (load, add, store); Adam on 8-bit moments
// goes through a block's fp32 values (adam_q8 below).
template <int S>
inline V::F load_state(const void* s, std::size_t i) {
  if constexpr (S == kStateF32) return V::load(static_cast<const float*>(s) + i);
  if constexpr (S == kStateBF16) return V::load_bf16(static_cast<const std::uint16_t*>(s) + i);
  if constexpr (S == kStateInt8) return V::load_i8(static_cast<const std::int8_t*>(s) + i);
}

template <int S>
inline void store_state(void* s, std::size_t i, V::F x) {
  if constexpr (S == kStateF32) V::store(static_cast<float*>(s) + i, x);
  if constexpr (S == kStateBF16) V::store_bf16(static_cast<std::uint16_t*>(s) + i, x);
  if constexpr (S == kStateInt8) V::store_i8(static_cast<std::int8_t*>(s) + i, x);
}

// The step's scalars, a local copy of the constants; adam_math broadcasts them where it uses them (a struct
// cannot hold SVE vectors), and the compiler keeps the broadcasts out of the loops.
using Broadcast = AdamConstants;

// One vector of elements starting at i. The operation order mirrors torch's single-tensor Adam:
//   g = g * scale (+ wd * p for Adam);  m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g;
//   p = p * (1 - lr * wd) for AdamW;  p = p - step_size * m / (sqrt(v) / sqrt(bc2) + eps).
// With bf16 moments the step uses the fp32 m and v it computed; only what is stored is rounded.
// The update itself, on a vector of loaded values (the gradient as stored, before its scale): every
// moment storage (fp32, bf16, 8-bit blocks) runs this one body.
// AMSGrad (amsgrad_body.inl) runs the same two halves with its running maximum of v between them.
template <bool L2>
inline void adam_moments(const Broadcast& b, V::F gv, const V::F& pv, V::F& mv, V::F& vv) {
  gv = V::mul(gv, V::set(b.grad_scale));
  if constexpr (L2) gv = V::fma(V::set(b.l2), pv, gv);
  mv = V::fma(V::set(b.one_minus_beta1), V::sub(gv, mv), mv);
  vv = V::fma(V::mul(V::set(b.one_minus_beta2), gv), gv, V::mul(vv, V::set(b.beta2)));
}

// p's update from m and the second moment its denominator uses (v, or AMSGrad's max of v).
inline void adam_param(const Broadcast& b, const V::F& mv, const V::F& second, V::F& pv) {
  const V::F denom = V::fma(V::sqrt(second), V::set(b.inv_bc2_sqrt), V::set(b.eps));
  pv = V::mul(pv, V::set(b.decay));
  pv = V::fma(V::set(b.neg_step_size), V::div(mv, denom), pv);
}

template <bool L2>
inline void adam_math(const Broadcast& b, V::F gv, V::F& pv, V::F& mv, V::F& vv) {
  adam_moments<L2>(b, gv, pv, mv, vv);
  adam_param(b, mv, vv, pv);
}

template <typename W>
concept StreamingStores = requires(float* p, typename W::F x) {
  W::stream(p, x);
  W::stream_fence();
};

// An fp32 array's store: plain, or (Stream, where V has it) one that bypasses the cache.
template <bool Stream, typename W = V>
inline void store_f32(float* p, typename W::F x) {
  if constexpr (Stream) {
    W::stream(p, x);
  } else {
    W::store(p, x);
  }
}

template <int G, int O, int S, bool L2, bool Stream>
inline void adam_lanes(const Broadcast& b, const StateIn& in, float* p, void* m, void* v, const void* g, void* out,
                       std::size_t i) {
  V::F pv = V::load(in.p + i), mv = load_state<S>(in.m, i), vv = load_state<S>(in.v, i);
  adam_math<L2>(b, load_grad<G>(g, i), pv, mv, vv);
  store_f32<Stream>(p + i, pv);
  if constexpr (S == kStateF32) {
    store_f32<Stream>(static_cast<float*>(m) + i, mv);
    store_f32<Stream>(static_cast<float*>(v) + i, vv);
  } else {
    store_state<S>(m, i, mv);
    store_state<S>(v, i, vv);
  }
  store_out<O>(out, i, pv);
}

// The bandwidth ceiling: the loads and stores of adam_lanes in place, one add each.
template <int G, int O, int S, bool, bool>
inline void streams_lanes(const Broadcast&, const StateIn& in, float* p, void* m, void* v, const void* g, void* out,
                          std::size_t i) {
  const V::F gv = load_grad<G>(g, i);
  const V::F pv = V::add(V::load(in.p + i), gv);
  V::store(p + i, pv);
  store_state<S>(m, i, V::add(load_state<S>(in.m, i), gv));
  store_state<S>(v, i, V::add(load_state<S>(in.v, i), gv));
  store_out<O>(out, i, pv);
}

inline void copy_bytes(void* dst, const void* src, std::size_t bytes) { __builtin_memcpy(dst, src, bytes); }

// Elements [i, i + count) (count <= lanes) through lane-sized buffers (zero-padded): a tail, or the head
// before the aligned part of a streamed run. The same vector code as the whole vectors, so the same bits.
template <int G, int O, int S, bool L2, template <int, int, int, bool, bool> class Lanes>
inline void staged(const Broadcast& b, const StateIn& in, float* p, void* m, void* v, const void* g, void* out,
                   std::size_t i, std::size_t tail) {
  alignas(64) float tp[V::max_lanes] = {}, tm[V::max_lanes] = {}, tv[V::max_lanes] = {}, tg[V::max_lanes] = {};
  alignas(64) std::uint16_t to[V::max_lanes] = {};
  copy_bytes(tp, in.p + i, tail * 4);
  copy_bytes(tm, static_cast<const unsigned char*>(in.m) + i * state_bytes(S), tail * state_bytes(S));
  copy_bytes(tv, static_cast<const unsigned char*>(in.v) + i * state_bytes(S), tail * state_bytes(S));
  copy_bytes(tg, static_cast<const unsigned char*>(g) + i * elem_bytes(G), tail * elem_bytes(G));
  const StateIn buffers{tp, tm, tv, nullptr, nullptr};
  Lanes<G, O, S, L2, false>::apply(b, buffers, tp, tm, tv, tg, to, 0);
  copy_bytes(p + i, tp, tail * 4);
  copy_bytes(static_cast<unsigned char*>(m) + i * state_bytes(S), tm, tail * state_bytes(S));
  copy_bytes(static_cast<unsigned char*>(v) + i * state_bytes(S), tv, tail * state_bytes(S));
  if constexpr (O != kOutNone) copy_bytes(static_cast<unsigned char*>(out) + i * out_bytes(O), to, tail * out_bytes(O));
}

// Out of place with fp32 state, where V streams: the elements before p is vector-aligned go staged, the
// rest with streaming stores when m and v are then aligned too. Returns n when it stepped them, 0 when it
// cannot stream. (W: V, named through a parameter so that a V without streaming stores compiles.)
template <int G, int O, int S, bool L2, template <int, int, int, bool, bool> class Lanes, typename W = V>
inline std::size_t run_streamed(const Broadcast& b, const StateIn& in, float* p, void* m, void* v, const void* g,
                                void* out, std::size_t n) {
  if constexpr (S != kStateF32 || !StreamingStores<W>) {
    return 0;
  } else {
    constexpr std::size_t kVector = sizeof(typename W::F);
    auto at = [](const void* x) { return reinterpret_cast<std::uintptr_t>(x); };
    if (in.p == p || at(p) % 4 != 0) return 0;
    const std::size_t head = (kVector - at(p) % kVector) % kVector / 4;
    if (head + W::lanes > n || (at(m) + head * 4) % kVector != 0 || (at(v) + head * 4) % kVector != 0) return 0;
    if (head > 0) staged<G, O, S, L2, Lanes>(b, in, p, m, v, g, out, 0, head);
    std::size_t i = head;
    for (; i + W::lanes <= n; i += W::lanes) Lanes<G, O, S, L2, true>::apply(b, in, p, m, v, g, out, i);
    W::stream_fence();
    if (i < n) staged<G, O, S, L2, Lanes>(b, in, p, m, v, g, out, i, n - i);
    return n;
  }
}

// Runs `Lanes` over whole vectors, then the tail staged; read from `in`, written to p, m, v.
template <int G, int O, int S, bool L2, template <int, int, int, bool, bool> class Lanes>
inline void run(const AdamConstants& c, const StateIn& in, float* p, void* m, void* v, const void* g, void* out,
                std::size_t n) {
  const Broadcast b(c);
  if (run_streamed<G, O, S, L2, Lanes>(b, in, p, m, v, g, out, n) != 0) return;
  std::size_t i = 0;
  for (; i + V::lanes <= n; i += V::lanes) Lanes<G, O, S, L2, false>::apply(b, in, p, m, v, g, out, i);
  if (i < n) staged<G, O, S, L2, Lanes>(b, in, p, m, v, g, out, i, n - i);
}

template <int G, int O, int S, bool L2, bool Stream>
struct AdamLanes {
  static void apply(const Broadcast& b, const StateIn& in, float* p, void* m, void* v, const void* g, void* out,
                    std::size_t i) {
    adam_lanes<G, O, S, L2, Stream>(b, in, p, m, v, g, out, i);
  }
};

// The ceiling steps in place: it never streams.
template <int G, int O, int S, bool L2, bool>
struct StreamsLanes {
  static void apply(const Broadcast& b, const StateIn& in, float* p, void* m, void* v, const void* g, void* out,
                    std::size_t i) {
    streams_lanes<G, O, S, L2, false>(b, in, p, m, v, g, out, i);
  }
};

template <int G, int O, int S>
void adam(const AdamConstants& c, const StateIn& in, float* p, void* m, void* v, const void* g, void* out,
          std::size_t n) {
  // Adam's L2 term is a separate instantiation so that AdamW and weight_decay = 0 never compute 0 * p
  // (which would turn an infinite weight into NaN where torch leaves it infinite).
  if (c.l2 != 0.0f) {
    run<G, O, S, true, AdamLanes>(c, in, p, m, v, g, out, n);
  } else {
    run<G, O, S, false, AdamLanes>(c, in, p, m, v, g, out, n);
  }
}

template <int G, int O, int S>
void streams(const AdamConstants& c, const StateIn& in, float* p, void* m, void* v, const void* g, void* out,
             std::size_t n) {
  run<G, O, S, false, StreamsLanes>(c, in, p, m, v, g, out, n);
}

// NaN/Inf test on the raw bits: an all-ones exponent. Counted in blocks (a loop the compiler vectorises);
// only a block that has one is searched for the first index.
template <int G>
struct GradBits {
  using T = std::uint16_t;
};
template <>
struct GradBits<kF32> {
  using T = std::uint32_t;
};

template <int G>
std::size_t count_non_finite(const void* g, std::size_t n, std::size_t* first) {
  using Bits = typename GradBits<G>::T;
  constexpr Bits kExp = G == kF32 ? Bits(0x7f800000u) : G == kF16 ? Bits(0x7c00u) : Bits(0x7f80u);
  const Bits* bits = static_cast<const Bits*>(g);
  constexpr std::size_t kBlock = 1024;
  std::size_t count = 0;
  *first = n;
  for (std::size_t start = 0; start < n; start += kBlock) {
    const std::size_t end = start + kBlock < n ? start + kBlock : n;
    std::uint32_t block_count = 0;
    for (std::size_t i = start; i < end; ++i) block_count += (bits[i] & kExp) == kExp;
    if (block_count != 0 && *first == n) {
      for (std::size_t i = start; i < end; ++i) {
        if ((bits[i] & kExp) == kExp) {
          *first = i;
          break;
        }
      }
    }
    count += block_count;
  }
  return count;
}

// Per block of kBlock values: the non-finite ones are counted on their bits; a block without any sums its
// squares in float lanes (fma), which is exact enough for a norm and as fast as the loads. A block whose
// float sum overflows, or is so small that squares may have underflowed, or that holds a NaN/Inf, is summed
// again element by element in double, skipping the non-finite values.
template <int G>
double sum_squares(const void* g, std::size_t n, std::uint64_t* non_finite) {
  constexpr std::size_t kBlock = 1024;
  double total = 0;
  *non_finite = 0;
  for (std::size_t start = 0; start < n; start += kBlock) {
    const std::size_t count = start + kBlock < n ? kBlock : n - start;
    const void* block = static_cast<const unsigned char*>(g) + start * elem_bytes(G);
    std::size_t first = 0;
    const std::size_t bad = count_non_finite<G>(block, count, &first);
    *non_finite += bad;
    double sum = 0;
    if (bad == 0) {
      // Four accumulators: the fma latency, not the loads, would otherwise set the pace.
      V::F acc0 = V::set(0.0f), acc1 = V::set(0.0f), acc2 = V::set(0.0f), acc3 = V::set(0.0f);
      auto square_add = [&](std::size_t at, V::F& acc) {
        const V::F x = load_grad<G>(block, at);
        acc = V::fma(x, x, acc);
      };
      std::size_t i = 0;
      for (; i + 4 * V::lanes <= count; i += 4 * V::lanes) {
        square_add(i, acc0);
        square_add(i + V::lanes, acc1);
        square_add(i + 2 * V::lanes, acc2);
        square_add(i + 3 * V::lanes, acc3);
      }
      for (; i + V::lanes <= count; i += V::lanes) square_add(i, acc0);
      alignas(64) float lanes[V::max_lanes];
      auto add_lanes = [&](V::F a) {
        V::store(lanes, a);
        for (std::size_t k = 0; k < V::lanes; ++k) sum += lanes[k];
      };
      add_lanes(acc0);
      add_lanes(acc1);
      add_lanes(acc2);
      add_lanes(acc3);
      for (; i < count; ++i) {
        const double x = scalar_grad<G>(block, i);
        sum += x * x;
      }
    }
    if (bad != 0 || !(sum < 1e37) || sum < 1e-30) {
      sum = 0;
      for (std::size_t i = 0; i < count; ++i) {
        const double x = scalar_grad<G>(block, i);
        if (x - x == 0) sum += x * x;
      }
    }
    total += sum;
  }
  return total;
}

// Gradient accumulation over micro-batches. Widening f16/bf16 to float is exact and the one addition is
// rounded once, so every ISA writes the same bits (NaN payloads aside).
//
// ConvertGrad widens g as the Adam kernels do. ShiftGrad, for the streams ceiling, reads the same bytes with
// the cheapest widening there is, a 16-bit shift: bf16's conversion, and a meaningless value for f16.
template <int G>
struct ConvertGrad {
  static V::F load(const void* g, std::size_t i) { return load_grad<G>(g, i); }
};

template <int G>
struct ShiftGrad {
  static V::F load(const void* g, std::size_t i) {
    if constexpr (G == kF32) {
      return V::load(static_cast<const float*>(g) + i);
    } else {
      return V::load_bf16(static_cast<const std::uint16_t*>(g) + i);
    }
  }
};

template <template <int> class Load, int G, int Mode>
inline void accumulate_lanes(float* acc, void* g, std::size_t i) {
  V::F x = Load<G>::load(g, i);
  if constexpr ((Mode & kAccumulateFirst) == 0) x = V::add(V::load(acc + i), x);
  V::store(acc + i, x);
  // All-zero bytes are +0 in f32, f16 and bf16; a memset of a fixed size compiles to one vector store.
  if constexpr ((Mode & kAccumulateZeroSource) != 0) {
    __builtin_memset(static_cast<unsigned char*>(g) + i * elem_bytes(G), 0, V::lanes * elem_bytes(G));
  }
}

// Whole vectors, then the tail through lane-sized buffers, as run() does. The first micro-batch never reads
// acc, not even in the tail: its old contents may be anything.
template <template <int> class Load, int G, int Mode>
void accumulate_run(float* acc, void* g, std::size_t n) {
  std::size_t i = 0;
  for (; i + V::lanes <= n; i += V::lanes) accumulate_lanes<Load, G, Mode>(acc, g, i);
  const std::size_t tail = n - i;
  if (tail == 0) return;
  alignas(64) float ta[V::max_lanes] = {}, tg[V::max_lanes] = {};  // tg holds lanes values of any grad type
  unsigned char* gi = static_cast<unsigned char*>(g) + i * elem_bytes(G);
  if constexpr ((Mode & kAccumulateFirst) == 0) copy_bytes(ta, acc + i, tail * 4);
  copy_bytes(tg, gi, tail * elem_bytes(G));
  accumulate_lanes<Load, G, Mode>(ta, tg, 0);
  copy_bytes(acc + i, ta, tail * 4);
  if constexpr ((Mode & kAccumulateZeroSource) != 0) copy_bytes(gi, tg, tail * elem_bytes(G));
}

// One instantiation per mode, chosen once per call: no per-element branch.
template <template <int> class Load, int G>
void accumulate_modes(float* acc, void* g, std::size_t n, int mode) {
  switch (mode & kAccumulateModeMask) {
    case kAccumulateAdd:
      return accumulate_run<Load, G, kAccumulateAdd>(acc, g, n);
    case kAccumulateFirst:
      return accumulate_run<Load, G, kAccumulateFirst>(acc, g, n);
    case kAccumulateZeroSource:
      return accumulate_run<Load, G, kAccumulateZeroSource>(acc, g, n);
    default:
      return accumulate_run<Load, G, kAccumulateFirst | kAccumulateZeroSource>(acc, g, n);
  }
}

template <int G>
void accumulate(float* acc, void* g, std::size_t n, int mode) {
  accumulate_modes<ConvertGrad, G>(acc, g, n, mode);
}

template <int G>
void accumulate_streams(float* acc, void* g, std::size_t n, int mode) {
  accumulate_modes<ShiftGrad, G>(acc, g, n, mode);
}
