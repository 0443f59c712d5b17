// zoe-train-gpt: the zoe demo's GPT trained from C++ — a libtorch model whose 16-bit weights and gradients
// zoe::OffloadOptimizer steps in place (fp32 masters and moments in RAM or on NVMe), with hyper-parameters,
// learning-rate schedule, clipping, fp16/bf16 and the offload tier from a DeepSpeed JSON config. What a C++
// trainer copies: the optimizer set up over the model's parameters (create_optimizer), gradients reported
// from autograd's post-accumulate hooks (GradReporter: the overlap schedule steps during backward), the loss
// scaled for fp16, the schedule applied before each step, and save/resume.
//
// Same data, model, seed and sizes as `python -m zoe.demo` (see docs/cpp.md, "C++ trainer (libtorch)", for
// what matches bitwise and what does not).
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <numbers>
#include <string>
#include <vector>

#include "examples/cpp-gpt/gpt.h"
#include "zoe/config.h"
#include "zoe/device.h"
#include "zoe/lr_schedule.h"
#include "zoe/offload.h"

namespace {

struct Args {
  std::string config, data, save, resume, losses_out, nvme_path;
  std::int64_t steps = 300, batch = 16, seq = 128, d_model = 192, layers = 4, heads = 6, warmup = 30, seed = 0;
  std::int64_t save_at = 0;  // with --save: the step after which to save (0: at the end)
  double lr = 2e-3;
  std::string schedule = "sync", tier = "ram", dtype = "bf16";
  int grad_accum = 1;
};

const char* kUsage = R"(usage: zoe-train-gpt --data FILE [options]

Trains the zoe demo's GPT (python -m zoe.demo) with zoe::OffloadOptimizer from C++ on the CPU.

  --data FILE          training text (bytes); `python -m zoe.demo --write-corpus FILE` writes the demo's
  --config FILE        DeepSpeed JSON: optimizer, scheduler, gradient_clipping, fp16/bf16,
                       gradient_accumulation_steps, zero_optimization.offload_optimizer, aio, zoe
  --steps N            optimizer steps (300)
  --batch B --seq T    batch of B windows of T bytes (16 x 128)
  --d-model D --layers L --heads H   model size (192, 4, 6)
  --lr X --warmup W    without a config scheduler: the demo's schedule, linear warmup over W steps then a
                       cosine to 0.1 X over the run (2e-3, 30)
  --schedule S         sync | overlap | delayed (a config's zoe.schedule wins)
  --tier T             ram | nvme (a config's offload_optimizer wins); --nvme-path DIR for nvme
  --dtype D            bf16 | fp16 weights (a config's fp16.enabled means fp16, with loss scaling)
  --grad-accum K       micro-batches per step (a config's gradient_accumulation_steps wins)
  --seed S             model and data seed (0)
  --save PATH          write zoe's checkpoint and PATH.trainer (data position) after --save-at or the last step
  --save-at N          the step after which --save writes
  --resume PATH        continue from a --save checkpoint
  --losses FILE        write one loss per step (and the held-out loss) as JSON
  --help
)";

bool parse_args(int argc, char** argv, Args& a) {
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "zoe-train-gpt: %s needs a value (--help)\n", k.c_str());
      return false;
    }
    const std::string v = argv[++i];
    auto num = [&](std::int64_t& out) {
      char* end = nullptr;
      out = std::strtoll(v.c_str(), &end, 10);
      return end != v.c_str() && *end == '\0';
    };
    bool ok = true;
    std::int64_t accum = 1;
    if (k == "--config") a.config = v;
    else if (k == "--data") a.data = v;
    else if (k == "--save") a.save = v;
    else if (k == "--resume") a.resume = v;
    else if (k == "--losses") a.losses_out = v;
    else if (k == "--nvme-path") a.nvme_path = v;
    else if (k == "--schedule") a.schedule = v;
    else if (k == "--tier") a.tier = v;
    else if (k == "--dtype") a.dtype = v;
    else if (k == "--lr") ok = (a.lr = std::atof(v.c_str())) > 0 && std::isfinite(a.lr);
    else if (k == "--steps") ok = num(a.steps);
    else if (k == "--batch") ok = num(a.batch);
    else if (k == "--seq") ok = num(a.seq);
    else if (k == "--d-model") ok = num(a.d_model);
    else if (k == "--layers") ok = num(a.layers);
    else if (k == "--heads") ok = num(a.heads);
    else if (k == "--warmup") ok = num(a.warmup);
    else if (k == "--seed") ok = num(a.seed);
    else if (k == "--save-at") ok = num(a.save_at);
    else if (k == "--grad-accum") ok = num(accum) && accum >= 1 && accum <= 1024 && (a.grad_accum = static_cast<int>(accum));
    else {
      std::fprintf(stderr, "zoe-train-gpt: unknown option %s (--help)\n", k.c_str());
      return false;
    }
    if (!ok) {
      std::fprintf(stderr, "zoe-train-gpt: %s %s is not a valid value\n", k.c_str(), v.c_str());
      return false;
    }
  }
  if (a.data.empty()) {
    std::fprintf(stderr, "zoe-train-gpt: --data FILE is required (python -m zoe.demo --write-corpus FILE writes the demo's text)\n");
    return false;
  }
  for (std::int64_t x : {a.steps, a.batch, a.seq, a.d_model, a.layers, a.heads, a.warmup}) {
    if (x < 1) {
      std::fprintf(stderr, "zoe-train-gpt: sizes, --steps and --warmup need at least 1\n");
      return false;
    }
  }
  if (a.d_model % a.heads != 0) {
    std::fprintf(stderr, "zoe-train-gpt: --d-model %lld is not a multiple of --heads %lld\n",
                 static_cast<long long>(a.d_model), static_cast<long long>(a.heads));
    return false;
  }
  return true;
}

// Random windows of the text as (input, next-byte target) batches, as the Python demo's ByteBatches draws
// them (torch.randint on a generator of its own), the last 5% held out.
struct ByteBatches {
  torch::Tensor train, held_out;
  std::int64_t seq, batch;
  at::Generator gen;

  ByteBatches(const std::vector<char>& text, std::int64_t s, std::int64_t b, std::uint64_t seed)
      : seq(s), batch(b), gen(at::make_generator<at::CPUGeneratorImpl>(seed)) {
    const torch::Tensor data =
        torch::from_blob(const_cast<char*>(text.data()), {static_cast<std::int64_t>(text.size())}, torch::kUInt8).to(torch::kLong);
    const auto split = static_cast<std::int64_t>(static_cast<double>(text.size()) * 0.95);
    train = data.slice(0, 0, split);
    held_out = data.slice(0, split);
  }
  std::pair<torch::Tensor, torch::Tensor> next(bool held = false) {
    const torch::Tensor& data = held ? held_out : train;
    const torch::Tensor start = torch::randint(0, data.size(0) - seq - 1, {batch}, gen);
    const torch::Tensor window = data.index({start.unsqueeze(1) + torch::arange(seq + 1)});
    return {window.slice(1, 0, seq), window.slice(1, 1)};
  }
};

// Reports each parameter's gradient to zoe once autograd has accumulated it (the C++ side of
// register_post_accumulate_grad_hook): the overlap schedule copies and steps it during the rest of
// backward; with gradient accumulation every schedule takes each micro-batch's gradient here.
struct GradReporter final : torch::autograd::PostAccumulateGradHook {
  zoe::OffloadOptimizer* opt;
  std::size_t index;
  const void* buffer;  // where zoe reads this gradient
  zoe::Status* first_error;
  GradReporter(zoe::OffloadOptimizer* o, std::size_t i, const void* b, zoe::Status* e)
      : opt(o), index(i), buffer(b), first_error(e) {}
  void operator()(const torch::autograd::Variable& param) override {
    // Autograd accumulates into the existing .grad in place; a new tensor would be outside zoe's view.
    if (param.grad().data_ptr() != buffer) {
      *first_error = zoe::invalid_argument("parameter " + std::to_string(index) + ": autograd replaced its .grad");
      return;
    }
    if (zoe::Status s = opt->grad_ready(index); !s.ok() && first_error->ok()) *first_error = s;
  }
};

struct Trainer {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  std::unique_ptr<zoe::Device> device = zoe::make_cpu_device();
  std::unique_ptr<zoe::OffloadOptimizer> opt;
  zoe::Status hook_error;
};

// The demo's two groups: weight decay on matrices and embeddings, none on biases and norms. Gradients are
// allocated once, before zoe sees them: zoe reads and writes this memory in place.
zoe::Status create_optimizer(gpt::GPT& model, const zoe::LoadedConfig& cfg, Trainer& t) {
  std::vector<zoe::ParamSpec> specs;
  std::vector<std::pair<std::string, torch::Tensor>> ordered;
  for (int group = 0; group < 2; ++group) {
    for (const auto& item : model->named_parameters()) {
      if ((item.value().dim() >= 2) == (group == 0)) ordered.emplace_back(item.key(), item.value());
    }
  }
  for (const auto& [name, p] : ordered) {
    p.mutable_grad() = torch::zeros_like(p);
    zoe::ParamSpec s;
    s.n = static_cast<std::size_t>(p.numel());
    s.dtype = p.scalar_type() == torch::kHalf ? zoe::DType::f16 : zoe::DType::bf16;
    s.device_weights = p.data_ptr();
    s.device_grads = p.grad().data_ptr();
    s.group = p.dim() >= 2 ? 0 : 1;
    s.name = name;
    s.shape.assign(p.sizes().begin(), p.sizes().end());
    specs.push_back(s);
    t.params.push_back(p);
    t.names.push_back(name);
  }
  zoe::ParamGroup decay{cfg.hyper}, no_decay{cfg.hyper};
  no_decay.hyper.weight_decay = 0.0f;
  zoe::Result<zoe::OffloadOptimizer> made =
      zoe::OffloadOptimizer::create(*t.device, {decay, no_decay}, std::move(specs), cfg.options);
  if (!made.ok()) return made.status();
  t.opt = std::make_unique<zoe::OffloadOptimizer>(std::move(made).value());
  for (std::size_t i = 0; i < t.params.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(
        t.params[i], std::make_unique<GradReporter>(t.opt.get(), i, t.params[i].grad().data_ptr(), &t.hook_error));
  }
  return zoe::Status::success();
}

// Command-line defaults shaped as a config (the demo's hyper-parameters), then the DeepSpeed file over them.
zoe::Result<zoe::LoadedConfig> load_config(const Args& a) {
  zoe::LoadedConfig cfg;
  if (!a.config.empty()) {
    zoe::Result<zoe::LoadedConfig> file = zoe::load_config_file(a.config);
    if (!file.ok()) return file.status();
    cfg = std::move(file).value();
    for (const std::string& n : cfg.notes) std::fprintf(stderr, "zoe-train-gpt: config: %s\n", n.c_str());
  } else {
    cfg.hyper.lr = static_cast<float>(a.lr);
    cfg.hyper.beta1 = 0.9f;
    cfg.hyper.beta2 = 0.95f;
    cfg.hyper.weight_decay = 0.1f;
    cfg.options.max_grad_norm = 1.0f;
    cfg.options.loss_scale.enabled = a.dtype == "fp16";
    cfg.options.gradient_accumulation_steps = a.grad_accum;
    zoe::Result<zoe::Schedule> s = zoe::parse_schedule(a.schedule);
    if (!s.ok()) return s.status();
    cfg.options.schedule = s.value();
    zoe::Result<zoe::Tier> tier = zoe::parse_tier(a.tier);
    if (!tier.ok()) return tier.status();
    cfg.options.tier = tier.value();
    if (!a.nvme_path.empty()) cfg.options.nvme.paths = {a.nvme_path};
  }
  if (cfg.options.tier == zoe::Tier::nvme && cfg.options.nvme.paths.empty()) {
    return zoe::invalid_argument("tier nvme needs a path: --nvme-path DIR or offload_optimizer.nvme_path");
  }
  return cfg;
}

// The demo's schedule when the config has none: lr * min(1, (s + 1) / warmup) * (0.1 + 0.45 * (1 + cos(pi *
// min(1, s / steps)))) for the step after s applied ones (torch's LambdaLR, stepped after each step).
double demo_lr(const Args& a, double base, std::int64_t s) {
  const double warm = std::min(1.0, static_cast<double>(s + 1) / static_cast<double>(a.warmup));
  const double done = std::min(1.0, static_cast<double>(s) / static_cast<double>(a.steps));
  return base * warm * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(std::numbers::pi * done)));
}

bool read_file(const std::string& path, std::vector<char>& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  out.assign(std::istreambuf_iterator<char>(f), {});
  return true;
}

// The data position beside zoe's checkpoint: the step reached and the generator's state.
bool save_trainer(const std::string& path, std::int64_t step, ByteBatches& data) {
  const torch::Tensor state = data.gen.get_state();
  std::ofstream f(path + ".trainer", std::ios::binary | std::ios::trunc);
  const std::int64_t n = state.numel();
  f.write(reinterpret_cast<const char*>(&step), sizeof step);
  f.write(reinterpret_cast<const char*>(&n), sizeof n);
  f.write(static_cast<const char*>(state.data_ptr()), n);
  return static_cast<bool>(f);
}

bool load_trainer(const std::string& path, std::int64_t& step, ByteBatches& data) {
  std::ifstream f(path + ".trainer", std::ios::binary);
  std::int64_t n = 0;
  if (!f.read(reinterpret_cast<char*>(&step), sizeof step) || !f.read(reinterpret_cast<char*>(&n), sizeof n)) return false;
  if (n <= 0 || n > (1 << 20)) return false;
  torch::Tensor state = torch::empty({n}, torch::kUInt8);
  if (!f.read(static_cast<char*>(state.data_ptr()), n)) return false;
  data.gen.set_state(state);
  return true;
}

int fail(const std::string& what) {
  std::fprintf(stderr, "zoe-train-gpt: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!parse_args(argc, argv, a)) return 2;
  zoe::Result<zoe::LoadedConfig> loaded = load_config(a);
  if (!loaded.ok()) return fail(loaded.status().to_string());
  const zoe::LoadedConfig& cfg = loaded.value();
  std::vector<char> text;
  if (!read_file(a.data, text) || static_cast<std::int64_t>(text.size()) < 40 * (a.seq + 2)) {
    return fail("--data " + a.data + ": cannot read it, or it holds too few bytes for --seq " + std::to_string(a.seq));
  }

  torch::manual_seed(static_cast<std::uint64_t>(a.seed));
  gpt::Config mc{256, a.seq, a.d_model, a.layers, a.heads};
  gpt::GPT model(mc);
  const bool fp16 = cfg.options.loss_scale.enabled;
  model->to(fp16 ? torch::kHalf : torch::kBFloat16);
  ByteBatches data(text, a.seq, a.batch, static_cast<std::uint64_t>(a.seed));
  ByteBatches held_data(text, a.seq, a.batch, static_cast<std::uint64_t>(a.seed + 1));
  std::vector<std::pair<torch::Tensor, torch::Tensor>> held;
  for (int k = 0; k < 4; ++k) held.push_back(held_data.next(true));

  Trainer t;
  if (zoe::Status s = create_optimizer(model, cfg, t); !s.ok()) return fail("creating the optimizer: " + s.to_string());
  std::int64_t first = 1;
  if (!a.resume.empty()) {
    if (zoe::Status s = t.opt->load(a.resume); !s.ok()) return fail("--resume: " + s.to_string());
    std::int64_t done = 0;
    if (!load_trainer(a.resume, done, data)) return fail("--resume: " + a.resume + ".trainer is missing or damaged");
    first = done + 1;
  }
  const int k = cfg.options.gradient_accumulation_steps;
  std::vector<double> group_lrs = {cfg.hyper.lr, cfg.hyper.lr};
  std::int64_t n_params = 0;
  for (const torch::Tensor& p : t.params) n_params += p.numel();
  std::printf("zoe-train-gpt: GPT %.2fM parameters (%lld layers, d=%lld), %s weights on the CPU (fp32 arithmetic); "
              "zoe tier %s, schedule %s, %d micro-batch(es) per step%s\n",
              static_cast<double>(n_params) / 1e6,
              static_cast<long long>(a.layers), static_cast<long long>(a.d_model), fp16 ? "fp16" : "bf16",
              std::string(zoe::tier_name(cfg.options.tier)).c_str(), std::string(zoe::schedule_name(cfg.options.schedule)).c_str(),
              k, cfg.has_scheduler ? (", scheduler " + std::string(zoe::lr_schedule_name(cfg.scheduler.type))).c_str() : "");

  std::vector<double> losses;
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t step = first; step <= a.steps; ++step) {
    if (cfg.has_scheduler) {
      cfg.scheduler.apply(*t.opt, group_lrs);
    } else {
      const double lr = demo_lr(a, cfg.hyper.lr, step - 1);
      for (std::size_t g = 0; g < 2; ++g) t.opt->group_hyper(g).lr = static_cast<float>(lr);
    }
    double step_loss = 0;
    for (int micro = 0; micro < k; ++micro) {
      auto [x, y] = data.next();
      torch::Tensor loss = model->loss(x, y);
      step_loss += loss.item<double>() / k;
      // fp16: the loss scaled so that small gradients survive; zoe unscales and skips overflows.
      (loss * (t.opt->loss_scale() / static_cast<double>(k))).backward();
      if (!t.hook_error.ok()) return fail("backward: " + t.hook_error.to_string());
    }
    if (zoe::Status s = t.opt->step(); !s.ok()) return fail("step " + std::to_string(step) + ": " + s.to_string());
    // The stand-in device's copies run on its own threads: done before the next backward writes gradients.
    if (zoe::Status s = t.device->synchronize(); !s.ok()) return fail(s.to_string());
    for (torch::Tensor& p : t.params) p.mutable_grad().zero_();  // in place: zoe keeps reading this memory
    losses.push_back(step_loss);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const auto done = step - first + 1;
    if (done % std::max<std::int64_t>(1, (a.steps - first + 1) / 10) == 0 || step == a.steps) {
      std::fprintf(stderr, "[%lld/%lld] loss %.4f | lr %.3g | %.0f tok/s | zoe step %.1f ms%s\n",
                   static_cast<long long>(step), static_cast<long long>(a.steps), step_loss, t.opt->group_hyper(0).lr,
                   static_cast<double>(done * a.batch * a.seq * k) / secs,
                   1e3 * t.opt->stats().step_call_s / static_cast<double>(done), t.opt->last_step_skipped() ? " (skipped: fp16 overflow)" : "");
    }
    if (!a.save.empty() && step == (a.save_at > 0 ? a.save_at : a.steps)) {
      if (zoe::Status s = t.opt->save(a.save); !s.ok()) return fail("--save: " + s.to_string());
      if (!save_trainer(a.save, step, data)) return fail("--save: cannot write " + a.save + ".trainer");
    }
  }
  if (zoe::Status s = t.opt->wait(); !s.ok()) return fail(s.to_string());
  double held_loss = 0;
  {
    torch::NoGradGuard no_grad;
    for (const auto& [x, y] : held) held_loss += model->loss(x, y).item<double>() / static_cast<double>(held.size());
  }
  std::printf("zoe-train-gpt: %zu steps, loss %.4f -> %.4f, held-out %.4f\n", losses.size(),
              losses.empty() ? 0.0 : losses.front(), losses.empty() ? 0.0 : losses.back(), held_loss);
  if (!a.losses_out.empty()) {
    std::FILE* f = std::fopen(a.losses_out.c_str(), "w");
    if (f == nullptr) return fail("--losses: cannot write " + a.losses_out);
    std::fprintf(f, "{\"first_step\": %lld, \"losses\": [", static_cast<long long>(first));
    for (std::size_t i = 0; i < losses.size(); ++i) std::fprintf(f, "%s%.17g", i ? ", " : "", losses[i]);
    // Each parameter's bytes hashed (FNV-1a): equal hashes are equal weights, for resume checks.
    std::fprintf(f, "], \"held_out_loss\": %.17g, \"weights_fnv1a\": {", held_loss);
    for (std::size_t i = 0; i < t.params.size(); ++i) {
      const torch::Tensor w = t.params[i].contiguous();
      std::uint64_t h = 1469598103934665603ull;
      const auto* b = static_cast<const unsigned char*>(w.data_ptr());
      for (std::size_t j = 0; j < static_cast<std::size_t>(w.nbytes()); ++j) h = (h ^ b[j]) * 1099511628211ull;
      std::fprintf(f, "%s\"%s\": \"%016llx\"", i ? ", " : "", t.names[i].c_str(), static_cast<unsigned long long>(h));
    }
    std::fprintf(f, "}}\n");
    std::fclose(f);
  }
  return 0;
}
