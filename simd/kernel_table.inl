// Every kernel of one ISA in its table (kernels.h): included last, by kernel_bodies.inl.

// One rule's entries: its kernel and its streams ceiling for each gradient, copy-out and state type.
template <typename Rule, typename Fn, int G, int O>
constexpr void fill_rule_row(RuleKernels<Fn>& r) {
  using Streams = StreamsRule<Rule::kStates, typename Rule::Constants>;
  r.step[G][O][kStateF32] = rule_step<Rule, G, O, kStateF32>;
  r.step[G][O][kStateBF16] = rule_step<Rule, G, O, kStateBF16>;
  r.streams[G][O][kStateF32] = rule_step<Streams, G, O, kStateF32>;
  r.streams[G][O][kStateBF16] = rule_step<Streams, G, O, kStateBF16>;
}

template <typename Rule, typename Fn, int G>
constexpr void fill_rule_grad(RuleKernels<Fn>& r) {
  fill_rule_row<Rule, Fn, G, kOutNone>(r);
  fill_rule_row<Rule, Fn, G, kOutF16>(r);
  fill_rule_row<Rule, Fn, G, kOutBF16>(r);
}

template <typename Rule, typename Fn>
constexpr RuleKernels<Fn> rule_kernels() {
  RuleKernels<Fn> r{};
  fill_rule_grad<Rule, Fn, kF32>(r);
  fill_rule_grad<Rule, Fn, kF16>(r);
  fill_rule_grad<Rule, Fn, kBF16>(r);
  return r;
}

// A template so that SVE's instance, whose lanes are read at run time, is simply not constexpr.
template <int = 0>
constexpr KernelTable make_table(const char* name, bool native_bf16) {
  return KernelTable{
      name,
      V::lanes,
      native_bf16,
      {{{adam<kF32, kOutNone, kStateF32>, adam<kF32, kOutNone, kStateBF16>},
        {adam<kF32, kOutF16, kStateF32>, adam<kF32, kOutF16, kStateBF16>},
        {adam<kF32, kOutBF16, kStateF32>, adam<kF32, kOutBF16, kStateBF16>}},
       {{adam<kF16, kOutNone, kStateF32>, adam<kF16, kOutNone, kStateBF16>},
        {adam<kF16, kOutF16, kStateF32>, adam<kF16, kOutF16, kStateBF16>},
        {adam<kF16, kOutBF16, kStateF32>, adam<kF16, kOutBF16, kStateBF16>}},
       {{adam<kBF16, kOutNone, kStateF32>, adam<kBF16, kOutNone, kStateBF16>},
        {adam<kBF16, kOutF16, kStateF32>, adam<kBF16, kOutF16, kStateBF16>},
        {adam<kBF16, kOutBF16, kStateF32>, adam<kBF16, kOutBF16, kStateBF16>}}},
      {{{streams<kF32, kOutNone, kStateF32>, streams<kF32, kOutNone, kStateBF16>},
        {streams<kF32, kOutF16, kStateF32>, streams<kF32, kOutF16, kStateBF16>},
        {streams<kF32, kOutBF16, kStateF32>, streams<kF32, kOutBF16, kStateBF16>}},
       {{streams<kF16, kOutNone, kStateF32>, streams<kF16, kOutNone, kStateBF16>},
        {streams<kF16, kOutF16, kStateF32>, streams<kF16, kOutF16, kStateBF16>},
        {streams<kF16, kOutBF16, kStateF32>, streams<kF16, kOutBF16, kStateBF16>}},
       {{streams<kBF16, kOutNone, kStateF32>, streams<kBF16, kOutNone, kStateBF16>},
        {streams<kBF16, kOutF16, kStateF32>, streams<kBF16, kOutF16, kStateBF16>},
        {streams<kBF16, kOutBF16, kStateF32>, streams<kBF16, kOutBF16, kStateBF16>}}},
      {{adam_q8<kF32, kOutNone>, adam_q8<kF32, kOutF16>, adam_q8<kF32, kOutBF16>},
       {adam_q8<kF16, kOutNone>, adam_q8<kF16, kOutF16>, adam_q8<kF16, kOutBF16>},
       {adam_q8<kBF16, kOutNone>, adam_q8<kBF16, kOutF16>, adam_q8<kBF16, kOutBF16>}},
      {{streams_q8<kF32, kOutNone>, streams_q8<kF32, kOutF16>, streams_q8<kF32, kOutBF16>},
       {streams_q8<kF16, kOutNone>, streams_q8<kF16, kOutF16>, streams_q8<kF16, kOutBF16>},
       {streams_q8<kBF16, kOutNone>, streams_q8<kBF16, kOutF16>, streams_q8<kBF16, kOutBF16>}},
      encode_q8,
      decode_q8,
      {count_non_finite<kF32>, count_non_finite<kF16>, count_non_finite<kBF16>},
      {sum_squares<kF32>, sum_squares<kF16>, sum_squares<kBF16>},
      {accumulate<kF32>, accumulate<kF16>, accumulate<kBF16>},
      {accumulate_streams<kF32>, accumulate_streams<kF16>, accumulate_streams<kBF16>},
      rule_kernels<AmsgradRule, AmsgradFn>(),
      rule_kernels<LionRule, LionFn>(),
      {{lion_q8<kF32, kOutNone>, lion_q8<kF32, kOutF16>, lion_q8<kF32, kOutBF16>},
       {lion_q8<kF16, kOutNone>, lion_q8<kF16, kOutF16>, lion_q8<kF16, kOutBF16>},
       {lion_q8<kBF16, kOutNone>, lion_q8<kBF16, kOutF16>, lion_q8<kBF16, kOutBF16>}},
      rule_kernels<AdagradRule, AdagradFn>(),
  };
}
