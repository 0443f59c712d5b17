// The optimizer with its compute stream on a stream it does not own (torch's current stream on a GPU: here a
// HostStream), on the host stand-in, with and without chaos (random delays before every piece of device
// work). The trainer's "backward" runs on that stream: each parameter's gradient is computed there from the
// weights that stream sees, so that a copy taken too early or weights sent too late change the numbers.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "zoe/host_device.h"
#include "tests/offload/trainer.h"
#include "zoe/offload.h"
#include "zoe/param_tier.h"

namespace zoe {
namespace {

using test::DeviceParams;

constexpr int kIterations = 8;
constexpr int kWarmup = 2;  // the delayed schedule's sync steps

struct Outcome {
  std::vector<float> state;
  std::vector<unsigned char> weights;
  std::vector<double> trainer_waits;  // per iteration, from the device's count
};

// Parameter b's gradient in iteration t, computed from its weights as the stream running it sees them.
void backward_of(DeviceParams& model, std::size_t b, int t) {
  const ParamSpec& p = model.specs[b];
  test::Random rng(1000 + 31 * t + b);
  for (std::size_t i = 0; i < p.n; ++i) {
    const float w = model.get(p.device_weights, i);
    model.set(const_cast<void*>(p.device_grads), i, 0.1f * w + static_cast<float>(rng.uniform(-1e-2, 1e-2)));
  }
}

// `foreign`: the trainer's work goes on a HostStream that is zoe's compute stream, and the host never waits
// for it. Otherwise the trainer waits for the device before every piece of its work (fully ordered).
Outcome train(Schedule schedule, bool foreign, std::uint64_t chaos_seed, double first_delay_s = 0) {
  HostDeviceOptions ho;
  ho.chaos_seed = chaos_seed;
  std::unique_ptr<Device> device = make_host_device(ho);
  HostStream torch_stream;
  if (foreign) {
    EXPECT_TRUE(device->use_compute_stream(torch_stream.handle()).ok());
  }
  DeviceParams model(*device, DType::bf16, {1000, 37, 4096, 1}, 42);
  OffloadOptions o;
  o.schedule = schedule;
  o.delayed_warmup_steps = kWarmup;
  o.cpu.threads = 2;
  o.cpu.tile = 512;
  o.tile = 700;
  Result<OffloadOptimizer> made = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o);
  EXPECT_TRUE(made.ok()) << made.status().to_string();
  Outcome out;
  if (!made.ok()) return out;
  OffloadOptimizer& opt = made.value();
  for (int t = 0; t < kIterations; ++t) {
    const std::uint64_t waits_before = device->host_waits().trainer_calls;
    for (std::size_t b = model.specs.size(); b-- > 0;) {
      if (foreign) {
        if (t == kWarmup + 1 && b + 1 == model.specs.size() && first_delay_s > 0) {
          torch_stream.enqueue([first_delay_s] { std::this_thread::sleep_for(std::chrono::duration<double>(first_delay_s)); });
        }
        torch_stream.enqueue([&model, b, t] { backward_of(model, b, t); });
      } else {
        EXPECT_TRUE(device->synchronize().ok());
        backward_of(model, b, t);
      }
      const auto start = std::chrono::steady_clock::now();
      EXPECT_TRUE(opt.grad_ready(b).ok());
      if (foreign && first_delay_s > 0 && t == kWarmup + 1) {
        EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), first_delay_s / 2)
            << "grad_ready must not wait for the foreign stream's work";
      }
    }
    const Status s = opt.step();
    EXPECT_TRUE(s.ok()) << s.to_string();
    out.trainer_waits.push_back(static_cast<double>(device->host_waits().trainer_calls - waits_before));
  }
  EXPECT_TRUE(opt.wait().ok());
  torch_stream.drain();
  EXPECT_TRUE(device->synchronize().ok());
  for (std::size_t i = 0; i < model.specs.size(); ++i) {
    std::vector<float> p(model.specs[i].n), m(p.size()), v(p.size());
    EXPECT_TRUE(opt.read_state(i, p.data(), m.data(), v.data()).ok());
    for (const auto* part : {&p, &m, &v}) out.state.insert(out.state.end(), part->begin(), part->end());
  }
  out.weights = model.weights();
  return out;
}

class ForeignStream : public ::testing::TestWithParam<Schedule> {};

TEST_P(ForeignStream, TrainsBitwiseAsTheFullyOrderedTrainerUnderChaos) {
  const Outcome want = train(GetParam(), false, 0);
  ASSERT_FALSE(want.state.empty());
  for (std::uint64_t seed : {1, 2}) {
    const Outcome got = train(GetParam(), true, seed);
    EXPECT_EQ(got.state, want.state) << "master/moments differ, chaos seed " << seed;
    EXPECT_EQ(got.weights, want.weights) << "device weights differ, chaos seed " << seed;
  }
}

// The trainer's thread runs ahead: grad_ready returns while the stream still sleeps before the gradient it
// names exists, and what zoe copies is what that stream writes afterwards (the result equals the ordered run).
// Host waits per iteration on the trainer's thread, after the warm-up: at most 2 in every schedule. sync
// waits once for the gradients, and once more only where the weights it sent up last step are still being
// copied when this step rewrites their staging — which an idle machine never shows and a loaded one may
// (a wait that finds the work done is not counted), so the bound is 2 and not a timing-dependent 1.
TEST_P(ForeignStream, TrainerRunsAheadWithinItsWaitBudget) {
  const Outcome want = train(GetParam(), false, 0);
  const Outcome got = train(GetParam(), true, 0, 0.2);
  EXPECT_EQ(got.state, want.state);
  EXPECT_EQ(got.weights, want.weights);
  for (int t = kWarmup + 1; t < kIterations; ++t) EXPECT_LE(got.trainer_waits[t], 2.0) << "iteration " << t;
}

INSTANTIATE_TEST_SUITE_P(Schedules, ForeignStream,
                         ::testing::Values(Schedule::sync, Schedule::overlap, Schedule::delayed),
                         [](const auto& p) { return std::string(schedule_name(p.param)); });

// Parameter offload on a foreign stream: fetch returns with the block's copy only enqueued; the caller's
// work on its stream reads the block, later; the block's room is given to another only after that stream
// has passed the release, and the host waited for none of it.
TEST(HostStream, ParamTierOrdersFetchAndReleaseOnTheForeignStream) {
  std::unique_ptr<Device> device = make_host_device();
  HostStream torch_stream;
  ASSERT_TRUE(device->use_compute_stream(torch_stream.handle()).ok());
  constexpr std::size_t kBytes = 64 << 10;
  ParamTierOptions o;
  o.budget_bytes = 2 * kBytes;  // two blocks: the third fetch must reuse the room of one released
  o.prefetch = 0;
  Result<ParamTier> made = ParamTier::create(*device, {{"a", {kBytes}}, {"b", {kBytes}}, {"c", {kBytes}}}, o);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  ParamTier& tier = made.value();
  std::vector<std::vector<unsigned char>> content(3, std::vector<unsigned char>(kBytes));
  for (std::size_t b = 0; b < 3; ++b) {
    std::memset(content[b].data(), static_cast<int>(0x11 * (b + 1)), kBytes);
    ASSERT_TRUE(tier.write(b, 0, content[b].data(), 0, kBytes).ok());
  }
  const std::uint64_t waits = device->host_waits().trainer_calls;
  std::vector<std::vector<unsigned char>> seen(3, std::vector<unsigned char>(kBytes));
  auto use = [&](std::size_t b, const void* at, double delay_s) {
    torch_stream.enqueue([&seen, b, at, delay_s] {
      std::this_thread::sleep_for(std::chrono::duration<double>(delay_s));
      std::memcpy(seen[b].data(), at, kBytes);
    });
  };
  const auto start = std::chrono::steady_clock::now();
  Result<void*> a = tier.fetch(0);
  ASSERT_TRUE(a.ok());
  use(0, a.value(), 0.2);  // the stream reads block a late
  ASSERT_TRUE(tier.release(0).ok());
  Result<void*> b = tier.fetch(1);
  ASSERT_TRUE(b.ok());
  use(1, b.value(), 0);
  ASSERT_TRUE(tier.release(1).ok());
  Result<void*> c = tier.fetch(2);  // evicts a (least recently used): its copy must wait for a's read
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c.value(), a.value()) << "the test expects c in a's room";
  use(2, c.value(), 0);
  ASSERT_TRUE(tier.release(2).ok());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 0.1)
      << "fetch and release must not wait for the caller's stream";
  EXPECT_EQ(device->host_waits().trainer_calls, waits);
  torch_stream.drain();
  ASSERT_TRUE(tier.synchronize().ok());
  for (std::size_t k = 0; k < 3; ++k) EXPECT_EQ(seen[k], content[k]) << "block " << k;
  ASSERT_TRUE(device->use_compute_stream(std::nullopt).ok());
}

TEST(HostStream, ComputeWorkGoesToTheForeignStream) {
  std::unique_ptr<Device> device = make_host_device();
  HostStream foreign;
  ASSERT_TRUE(device->use_compute_stream(foreign.handle()).ok());
  EXPECT_EQ(device->use_compute_stream(0).code(), StatusCode::invalid_argument);
  std::atomic<bool> gate{false};
  foreign.enqueue([&gate] {
    while (!gate) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  ASSERT_TRUE(device->simulate_compute(0, Stream::compute).ok());
  Result<EventId> e = device->record(Stream::compute);
  ASSERT_TRUE(e.ok());
  Result<EventId> d2h = device->record(Stream::d2h);
  ASSERT_TRUE(d2h.ok());
  ASSERT_TRUE(device->synchronize(d2h.value()).ok()) << "zoe's own streams do not wait for the foreign one";
  gate = true;
  ASSERT_TRUE(device->synchronize(e.value()).ok());
  ASSERT_TRUE(device->use_compute_stream(std::nullopt).ok());
  foreign.drain();
}

}  // namespace
}  // namespace zoe
