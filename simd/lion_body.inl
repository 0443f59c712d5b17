// Lion (Chen et al. 2023, arXiv 2302.06675, the paper's Algorithm 2), one moment m (torch's name: exp_avg):
//   g = g * scale;  u = sign(beta1 * m + (1 - beta1) * g);
//   p = p * (1 - lr * weight_decay) - lr * u;  m = beta2 * m + (1 - beta2) * g.
// The weight decay is decoupled and applied as torch's AdamW applies it, p scaled before the update (the
// paper's reference code does the same); issue 53 writes p - lr * (u + wd * p), equal in exact arithmetic and
// one rounding apart. sign is torch.sign's: (x > 0) - (x < 0), so 0 for +-0 and for NaN. lr * u is lr, -lr or
// 0, exact, so p's update rounds once. With bf16 moments, u and the new m come from the widened fp32 m; only
// the stored m is rounded.
struct LionRule {
  static constexpr int kStates = 1;
  using Constants = LionConstants;
  static bool variant(const Constants&) { return false; }

  template <int G, int O, int S, bool, bool Stream>
  static void lanes(const Constants& c, const StepArrays<1>& a, std::size_t i) {
    const V::F g = V::mul(load_grad<G>(a.g, i), V::set(c.grad_scale));
    const V::F m = load_state<S>(a.state_in[0], i);
    const V::F u = V::sign(V::fma(V::set(c.one_minus_beta1), g, V::mul(m, V::set(c.beta1))));
    V::F p = V::mul(V::load(a.p_in + i), V::set(c.decay));
    p = V::fma(V::set(c.neg_lr), u, p);
    store_f32<Stream>(a.p + i, p);
    store_state_as<S, Stream>(a.state[0], i, V::fma(V::set(c.one_minus_beta2), g, V::mul(m, V::set(c.beta2))));
    store_out<O>(a.out, i, p);
  }
};

// Lion with 8-bit moments (kernels.h's code for m): each block of kQuantBlock elements decoded into fp32,
// stepped by LionRule's lanes as the fp32 kernel steps it (whole vectors, then the tail staged; no streaming
// stores, the block is read again at once), and encoded again with its new scale, max |m|. Read from `in`
// (p, the codes and their scales), written to p, m and m_scale: a block's codes are encoded only after the
// whole block was stepped, so in place is one case of out of place.
template <int G, int O>
void lion_q8(const LionConstants& constants, const StateIn& in, float* p, std::int8_t* m, float* m_scale,
             const void* g, void* out, std::size_t n) {
  const LionConstants c = constants;
  alignas(64) float tm[kQuantBlock + V::max_lanes];  // room for a whole last vector
  for (std::size_t start = 0, j = 0; start < n; start += kQuantBlock, ++j) {
    const std::size_t count = n - start < kQuantBlock ? n - start : kQuantBlock;
    decode_block(static_cast<const std::int8_t*>(in.m) + start, nullptr, in.m_scale[j], 0.0f, tm, nullptr, count);
    const StepArrays<1> a{in.p + start,
                          {tm},
                          p + start,
                          {tm},
                          static_cast<const unsigned char*>(g) + start * elem_bytes(G),
                          O == kOutNone ? nullptr : static_cast<unsigned char*>(out) + start * out_bytes(O)};
    std::size_t i = 0;
    for (; i + V::lanes <= count; i += V::lanes) LionRule::lanes<G, O, kStateF32, false, false>(c, a, i);
    if (i < count) rule_staged<LionRule, G, O, kStateF32, false>(c, a, i, count - i);
    m_scale[j] = block_max(tm, count, true);
    encode_m(tm, count, m_scale[j], m + start);
  }
}
