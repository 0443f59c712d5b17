// Adam/AdamW with amsgrad, as torch.optim.Adam(amsgrad=True)'s single-tensor path (Reddi, Kale & Kumar 2018):
// Adam's moments (adam_moments), then v_max = max(v_max, v) and the denominator from v_max instead of v
// (adam_param). Three state arrays: m, v, v_max. V::max keeps its second operand when either is NaN, so a NaN
// v reaches v_max as torch.maximum's would; only a NaN already in v_max beside a finite v differs (torch keeps
// the NaN), which no step produces: a NaN v stays NaN. Rounding is monotone, so with bf16 moments the stored
// v_max is still >= the stored v and >= the v_max read.
struct AmsgradRule {
  static constexpr int kStates = 3;
  using Constants = AdamConstants;
  static bool variant(const Constants& c) { return c.l2 != 0.0f; }  // as adam(): no 0 * p for AdamW

  template <int G, int O, int S, bool L2, bool Stream>
  static void lanes(const Constants& c, const StepArrays<3>& a, std::size_t i) {
    V::F pv = V::load(a.p_in + i), mv = load_state<S>(a.state_in[0], i), vv = load_state<S>(a.state_in[1], i);
    const V::F vmax_in = load_state<S>(a.state_in[2], i);
    adam_moments<L2>(c, load_grad<G>(a.g, i), pv, mv, vv);
    const V::F vmax = V::max(vmax_in, vv);
    adam_param(c, mv, vmax, pv);
    store_f32<Stream>(a.p + i, pv);
    store_state_as<S, Stream>(a.state[0], i, mv);
    store_state_as<S, Stream>(a.state[1], i, vv);
    store_state_as<S, Stream>(a.state[2], i, vmax);
    store_out<O>(a.out, i, pv);
  }
};
