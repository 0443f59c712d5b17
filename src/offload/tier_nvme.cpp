// Tier nvme: the fp32 master weights and moments of the flattened parameters in a swap store (zoe/swap.h),
// streamed through a few RAM buffers by each step; never whole in RAM.
#include <algorithm>
#include <vector>

#include "src/offload/checkpoint.h"
#include "src/offload/optimizer_impl.h"
#include "zoe/swap.h"

namespace zoe {
#ifdef ZOE_HAVE_AIO
namespace {

class NvmeTier final : public StateTier {
 public:
  NvmeTier(Impl& m, SwapStore store) : m_(m), store_(std::move(store)) {}

  // The store starts from the device's 16-bit weights, widened tile by tile.
  Status initialize() override {
    std::size_t param = 0;
    return store_.initialize([this, &param](std::size_t offset, std::size_t count, float* p) {
      for (std::size_t done = 0; done < count;) {
        while (m_.offsets[param + 1] <= offset + done) ++param;
        const std::size_t at = offset + done - m_.offsets[param];
        const std::size_t n = std::min(count - done, m_.params[param].n - at);
        const auto* w = static_cast<const std::uint16_t*>(m_.weights_of(param)) + at;
        const bool f16 = m_.params[param].dtype == DType::f16;
        for (std::size_t k = 0; k < n; ++k) p[done + k] = f16 ? f16_to_float(w[k]) : bf16_to_float(w[k]);
        done += n;
      }
      return Status::success();
    });
  }

  // Every parameter in one streamed pass: the store cannot step pieces one at a time.
  Status step(const std::vector<std::size_t>& which, float grad_scale, int set,
              const std::vector<ParamGroup>& hyper) override {
    if (which.size() != m_.pieces.size()) {
      return invalid_argument("tier nvme steps every piece at once (" + std::to_string(which.size()) + " of " +
                              std::to_string(m_.pieces.size()) + " asked)");
    }
    std::vector<SwapSegment> segments;
    for (std::size_t i = 0; i < m_.params.size(); ++i) {
      const ParamSpec& p = m_.params[i];
      if (p.n == 0) continue;
      DType grad_dtype;
      const void* grad = m_.step_grad(i, set, &grad_dtype);
      segments.push_back({m_.offsets[i], p.n, &hyper[p.group].hyper, grad, grad_dtype, m_.weights_of(i), p.dtype});
    }
    StepOptions o;
    o.step = m_.step_count.load() + 1;
    o.grad_scale = grad_scale;
    const Status s = store_.step(segments, o);
    const SwapStats& io = store_.last_stats();
    StepStats& st = m_.stats_;
    st.adam_s += io.total_s;
    st.nvme_read_bytes += io.read_bytes;
    st.nvme_write_bytes += io.write_bytes;
    st.nvme_read_s += io.read_s;
    st.nvme_write_s += io.write_s;
    return s;
  }

  Status read(std::size_t offset, std::size_t count, float* p, float* m, float* v) override {
    return store_.read(offset, count, p, m, v);
  }
  Status write(std::size_t offset, std::size_t count, const float* p, const float* m, const float* v) override {
    return store_.write(offset, count, p, m, v);
  }

  // The state does not fit in RAM: verify every blob first, then stream it into the swap store.
  Status load(const CheckpointReader& reader, const std::string& path, std::int64_t step) override {
    const std::size_t total = m_.offsets.back();
    const char* names[3] = {"master", "exp_avg", "exp_avg_sq"};
    for (const char* name : names) {
      const Status s = reader.read_streamed(name, total * 4, CheckpointWriter::kStreamSlice,
                                            [](std::size_t, const void*, std::size_t) { return Status::success(); });
      if (!s.ok()) return s;
    }
    for (int k = 0; k < 3; ++k) {
      const Status s = reader.read_streamed(names[k], total * 4, CheckpointWriter::kStreamSlice,
                                            [&](std::size_t offset, const void* data, std::size_t n) {
        const float* arrays[3] = {nullptr, nullptr, nullptr};
        arrays[k] = static_cast<const float*>(data);
        return store_.write(offset / 4, n / 4, arrays[0], arrays[1], arrays[2]);
      });
      if (!s.ok()) {
        return Status(s.code(), s.message() + " — while loading " + path + " into the swap store, whose state is now "
                                "partly the checkpoint's: load again, or start afresh", s.sys_errno());
      }
    }
    return store_.set_step(step);
  }

  Status flush() override { return store_.flush(); }

  bool in_ram() const override { return false; }

 private:
  Impl& m_;
  SwapStore store_;
};

}  // namespace

Result<std::unique_ptr<StateTier>> make_nvme_tier(Impl& m, const char* name) {
  SwapOptions so = SwapOptions::from(m.options.nvme);
  so.adam = &m.adam;
  so.state_dtype = m.options.state_dtype;  // bf16 moments: slots of 8 bytes per element instead of 12
  // Tiles are whole O_DIRECT blocks of fp32 values.
  const std::size_t align_elems = std::max<std::size_t>(so.alignment, 4096) / 4;
  const std::size_t tile = (std::max<std::size_t>(m.options.tile, 1) + align_elems - 1) / align_elems * align_elems;
  if (Status s = SwapStore::remove(so, name); !s.ok()) return s;
  Result<SwapStore> made = SwapStore::create(so, name, m.offsets.back(), tile);
  if (!made.ok()) return made.status();
  return std::unique_ptr<StateTier>(std::make_unique<NvmeTier>(m, std::move(made).value()));
}
#else
Result<std::unique_ptr<StateTier>> make_nvme_tier(Impl&, const char*) {
  return Status(StatusCode::unsupported, "tier nvme: this build of zoe has no libaio NVMe tier (-Daio=disabled)");
}
#endif

}  // namespace zoe
