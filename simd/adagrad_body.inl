// Adagrad as torch.optim.Adagrad's single-tensor path (Duchi, Hazan & Singer 2011), one state array `sum`:
//   g = g * scale (+ weight_decay * p);  sum = sum + g * g;  p = p - clr * g / (sqrt(sum) + eps),
// clr = lr / (1 + (step - 1) * lr_decay) computed on the host in double, as torch computes it in Python.
// sum + g * g rounds the product and the sum, as torch's addcmul_ (value 1) does. The L2 term is a separate
// instantiation, taken only when weight_decay != 0 as torch tests it, so that 0 * p never turns an infinite
// weight into NaN. With a bf16 sum, the step uses the fp32 sum it computed; only what is stored is rounded.
struct AdagradRule {
  static constexpr int kStates = 1;
  using Constants = AdagradConstants;
  static bool variant(const Constants& c) { return c.l2 != 0.0f; }

  template <int G, int O, int S, bool L2, bool Stream>
  static void lanes(const Constants& c, const StepArrays<1>& a, std::size_t i) {
    V::F p = V::load(a.p_in + i);
    V::F g = V::mul(load_grad<G>(a.g, i), V::set(c.grad_scale));
    if constexpr (L2) g = V::fma(V::set(c.l2), p, g);
    const V::F sum = V::add(load_state<S>(a.state_in[0], i), V::mul(g, g));
    const V::F denom = V::add(V::sqrt(sum), V::set(c.eps));
    p = V::fma(V::set(c.neg_clr), V::div(g, denom), p);
    store_f32<Stream>(a.p + i, p);
    store_state_as<S, Stream>(a.state[0], i, sum);
    store_out<O>(a.out, i, p);
  }
};
