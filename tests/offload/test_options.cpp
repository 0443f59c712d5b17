// The option table (option_fields(), zoe/offload.h): every OffloadOptions field once, by the name front-ends
// use, read and written through it without loss; a value a field cannot hold refused naming the field, with
// the options as they were.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "zoe/offload.h"

namespace zoe {
namespace {

const OptionField& field(std::string_view name) {
  for (const OptionField& f : option_fields()) {
    if (f.name == name) return f;
  }
  ADD_FAILURE() << "no option " << name;
  return option_fields()[0];
}

TEST(OptionTable, NamesAreUniqueAndEveryValueRoundTrips) {
  std::set<std::string_view> names;
  const OffloadOptions defaults;
  for (const OptionField& f : option_fields()) {
    EXPECT_TRUE(names.insert(f.name).second) << f.name << " is listed twice";
    OffloadOptions o;
    ASSERT_TRUE(f.set(o, f.get(defaults)).ok()) << f.name;
    EXPECT_EQ(f.get(o), f.get(defaults)) << f.name;
  }
}

TEST(OptionTable, SetsTheFieldItNames) {
  OffloadOptions o;
  ASSERT_TRUE(field("tier").set(o, std::string("nvme")).ok());
  ASSERT_TRUE(field("nvme_paths").set(o, std::vector<std::string>{"/a", "/b"}).ok());
  ASSERT_TRUE(field("buffer_count").set(o, std::int64_t{7}).ok());
  ASSERT_TRUE(field("nvme_durability").set(o, std::string("checkpoint")).ok());
  ASSERT_TRUE(field("state_dtype").set(o, std::string("int8")).ok());
  ASSERT_TRUE(field("schedule").set(o, std::string("delayed")).ok());
  ASSERT_TRUE(field("partition_grads_averaged").set(o, true).ok());
  ASSERT_TRUE(field("min_scale").set(o, 0.25).ok());
  ASSERT_TRUE(field("threads").set(o, std::int64_t{3}).ok());
  ASSERT_TRUE(field("isa").set(o, std::string("scalar")).ok());
  EXPECT_EQ(o.tier, Tier::nvme);
  EXPECT_EQ(o.nvme.paths, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(o.nvme.buffer_count, 7);
  EXPECT_EQ(o.nvme.durability, Durability::checkpoint);
  EXPECT_EQ(o.state_dtype, DType::i8);
  EXPECT_EQ(o.schedule, Schedule::delayed);
  EXPECT_TRUE(o.partition.grads_averaged);
  EXPECT_EQ(o.loss_scale.min_scale, 0.25f);
  EXPECT_EQ(o.cpu.threads, 3);
  EXPECT_EQ(o.cpu.isa, "scalar");
}

TEST(OptionTable, RefusesWhatAFieldCannotHoldNamingItAndChangingNothing) {
  struct Case {
    std::string_view name;
    OptionValue value;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"tile", std::int64_t{-1}, "tile = -1 is invalid: need an integer from 0 to"},
      {"threads", std::int64_t{1} << 40, "threads = 1099511627776 is invalid: need an integer from"},
      {"schedule", std::string("eager"), "schedule: schedule 'eager' is unknown: use sync, overlap or delayed"},
      {"nvme_durability", std::string("never"), "nvme_durability: durability 'never' is unknown"},
      {"initial_scale", double{INFINITY}, "initial_scale = inf is invalid: need a finite number > 0"},
      {"min_scale", 0.0, "min_scale = 0 is invalid: need a finite number > 0"},
      {"loss_scale", std::int64_t{1}, "loss_scale: the value is of another kind than the option"},
  };
  for (const Case& c : cases) {
    OffloadOptions o;
    const OptionValue before = field(c.name).get(o);
    const Status s = field(c.name).set(o, c.value);
    EXPECT_EQ(s.code(), StatusCode::invalid_argument) << c.name;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s.message();
    EXPECT_EQ(field(c.name).get(o), before) << c.name;
  }
}

TEST(OptionTable, ChoiceNamesRoundTrip) {
  for (Tier t : {Tier::ram, Tier::nvme}) EXPECT_EQ(parse_tier(tier_name(t)).value(), t);
  for (Schedule s : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    EXPECT_EQ(parse_schedule(schedule_name(s)).value(), s);
  }
  for (Durability d : {Durability::step, Durability::checkpoint}) {
    EXPECT_EQ(parse_durability(durability_name(d)).value(), d);
  }
  for (DType d : {DType::f32, DType::bf16, DType::i8}) EXPECT_EQ(parse_state_dtype(state_dtype_name(d)).value(), d);
  EXPECT_FALSE(parse_state_dtype("fp16").ok());
}

}  // namespace
}  // namespace zoe
