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
