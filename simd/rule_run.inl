// The loop every rule beside Adam runs (Lion, Adagrad, AMSGrad: lion_body.inl, adagrad_body.inl,
// amsgrad_body.inl), written once over V as adam_body.inl's run() is: whole vectors, the tail staged through
// zero-padded lane buffers (the same vector code, so the same bits for any split into calls), and a step out
// of place with fp32 state written by streaming stores where V has them. Included after adam_body.inl, whose
// loads, stores and staging helpers it uses. Unlike run(), the loop prefetches ahead (kPrefetchAhead).
//
// A rule is a struct with
//   static constexpr int kStates;          its state arrays (StepArrays<kStates>, kernels.h)
//   using Constants;                       its per-step scalars
//   static bool variant(const Constants&)  which of two instantiations a call runs (an L2 term or none)
//   template <int G, int O, int S, bool Variant, bool Stream>
//   static void lanes(const Constants&, const StepArrays<kStates>&, std::size_t i)
// where lanes steps the vector of elements at i: every load before any store, so in place is one case of
// out of place, and fp32 state stored through store_state_as<S, Stream>.

// A state array's store: fp32 plain or (Stream) bypassing the cache, bf16 rounded to nearest even.
template <int S, bool Stream>
inline void store_state_as(void* s, std::size_t i, V::F x) {
  if constexpr (S == kStateF32) {
    store_f32<Stream>(static_cast<float*>(s) + i, x);
  } else {
    store_state<S>(s, i, x);
  }
}

// A software prefetch this many elements ahead of every array the loop reads (p, each state array, the
// gradient), once per vector. With Lion's and Adagrad's one state array the hardware prefetchers alone left
// bandwidth unused: on a shared 2-core AVX-512 VM, zoe bench adam --optimizer lion at 64M fp32 ran at 0.93 of
// the plain streams loop without it and 1.09 with it, and 4 to 28% faster in interleaved runs of the two
// builds. The streams ceiling runs through this loop too, so it gets the same prefetches and ratio compares
// like with like. A prefetch never faults, so one past an array's end is harmless; its address is computed as
// an integer, so no pointer leaves its array. (Adam's run() does not prefetch: not measured there yet.)
constexpr std::size_t kPrefetchAhead = 512;

template <int G, int S, int K>
inline void prefetch_ahead(const StepArrays<K>& a, std::size_t i) {
  auto ahead = [i](const void* base, std::size_t elem_size) {
    const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(base) + (i + kPrefetchAhead) * elem_size;
    __builtin_prefetch(reinterpret_cast<const void*>(at));
  };
  ahead(a.p_in, 4);
  for (int k = 0; k < K; ++k) ahead(a.state_in[k], state_bytes(S));
  ahead(a.g, elem_bytes(G));
}

// Elements [i, i + count) (count <= lanes) through lane-sized buffers: a tail, or the head before the
// aligned part of a streamed run.
template <typename Rule, int G, int O, int S, bool Variant>
inline void rule_staged(const typename Rule::Constants& c, const StepArrays<Rule::kStates>& a, std::size_t i,
                        std::size_t count) {
  constexpr int K = Rule::kStates;
  alignas(64) float tp[V::max_lanes] = {}, tg[V::max_lanes] = {};  // tg holds lanes values of any grad type
  alignas(64) float ts[K][V::max_lanes] = {};
  alignas(64) std::uint16_t to[V::max_lanes] = {};
  StepArrays<K> buffers{};
  buffers.p_in = tp;
  buffers.p = tp;
  buffers.g = tg;
  buffers.out = to;
  copy_bytes(tp, a.p_in + i, count * 4);
  copy_bytes(tg, static_cast<const unsigned char*>(a.g) + i * elem_bytes(G), count * elem_bytes(G));
  for (int k = 0; k < K; ++k) {
    copy_bytes(ts[k], static_cast<const unsigned char*>(a.state_in[k]) + i * state_bytes(S), count * state_bytes(S));
    buffers.state_in[k] = ts[k];
    buffers.state[k] = ts[k];
  }
  Rule::template lanes<G, O, S, Variant, false>(c, buffers, 0);
  copy_bytes(a.p + i, tp, count * 4);
  for (int k = 0; k < K; ++k) {
    copy_bytes(static_cast<unsigned char*>(a.state[k]) + i * state_bytes(S), ts[k], count * state_bytes(S));
  }
  if constexpr (O != kOutNone) {
    copy_bytes(static_cast<unsigned char*>(a.out) + i * out_bytes(O), to, count * out_bytes(O));
  }
}

// Out of place with fp32 state, where V streams: the elements before p is vector-aligned go staged, the rest
// with streaming stores when every state array is then aligned too. Returns n when it stepped them, 0 when it
// cannot stream. (W: V, named through a parameter so that a V without streaming stores compiles.)
template <typename Rule, int G, int O, int S, bool Variant, typename W = V>
inline std::size_t rule_run_streamed(const typename Rule::Constants& c, const StepArrays<Rule::kStates>& a,
                                     std::size_t n) {
  if constexpr (S != kStateF32 || !StreamingStores<W>) {
    return 0;
  } else {
    constexpr std::size_t kVector = sizeof(typename W::F);
    auto at = [](const void* x) { return reinterpret_cast<std::uintptr_t>(x); };
    if (a.p_in == a.p || at(a.p) % 4 != 0) return 0;
    const std::size_t head = (kVector - at(a.p) % kVector) % kVector / 4;
    if (head + W::lanes > n) return 0;
    for (int k = 0; k < Rule::kStates; ++k) {
      if ((at(a.state[k]) + head * 4) % kVector != 0) return 0;
    }
    if (head > 0) rule_staged<Rule, G, O, S, Variant>(c, a, 0, head);
    std::size_t i = head;
    for (; i + W::lanes <= n; i += W::lanes) {
      prefetch_ahead<G, S, Rule::kStates>(a, i);
      Rule::template lanes<G, O, S, Variant, true>(c, a, i);
    }
    W::stream_fence();
    if (i < n) rule_staged<Rule, G, O, S, Variant>(c, a, i, n - i);
    return n;
  }
}

template <typename Rule, int G, int O, int S, bool Variant>
inline void rule_run(const typename Rule::Constants& c, const StepArrays<Rule::kStates>& a, std::size_t n) {
  if (rule_run_streamed<Rule, G, O, S, Variant>(c, a, n) != 0) return;
  std::size_t i = 0;
  for (; i + V::lanes <= n; i += V::lanes) {
    prefetch_ahead<G, S, Rule::kStates>(a, i);
    Rule::template lanes<G, O, S, Variant, false>(c, a, i);
  }
  if (i < n) rule_staged<Rule, G, O, S, Variant>(c, a, i, n - i);
}

// A rule's kernel: the instantiation its constants ask for, chosen once per call. The constants and pointers
// are copied to locals first, as run() copies Adam's: stores through the arrays cannot then alias them, and
// the compiler keeps their loads and broadcasts out of the loops.
template <typename Rule, int G, int O, int S>
void rule_step(const typename Rule::Constants& constants, const StepArrays<Rule::kStates>& arrays, std::size_t n) {
  const typename Rule::Constants c = constants;
  const StepArrays<Rule::kStates> a = arrays;
  if (Rule::variant(c)) {
    rule_run<Rule, G, O, S, true>(c, a, n);
  } else {
    rule_run<Rule, G, O, S, false>(c, a, n);
  }
}

// The bandwidth ceiling of a rule with K state arrays: its loads and stores, one addition each, plain stores
// (as Adam's StreamsLanes, it never streams).
template <int K, typename C>
struct StreamsRule {
  static constexpr int kStates = K;
  using Constants = C;
  static bool variant(const Constants&) { return false; }
  template <int G, int O, int S, bool, bool>
  static void lanes(const Constants&, const StepArrays<K>& a, std::size_t i) {
    const V::F gv = load_grad<G>(a.g, i);
    const V::F pv = V::add(V::load(a.p_in + i), gv);
    V::store(a.p + i, pv);
    for (int k = 0; k < K; ++k) store_state<S>(a.state[k], i, V::add(load_state<S>(a.state_in[k], i), gv));
    store_out<O>(a.out, i, pv);
  }
};
