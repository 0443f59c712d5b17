// zoe._zoe's CpuAdam: the multi-tensor CPU Adam kernel over numpy arrays or CPU tensors, stepped with the
// GIL released.
#include "python/src/binding.h"

namespace zoe::python {
namespace {

struct PyCpuAdam {
  CpuAdam adam;

  // Lists of equal length; `outs` may be empty (no 16-bit copy) or hold one array (or None) per tensor.
  void step(std::vector<F32Array> params, std::vector<F32Array> exp_avgs, std::vector<F32Array> exp_avg_sqs,
            std::vector<CpuArray> grads, std::vector<std::optional<CpuArray>> outs, std::int64_t step, float lr,
            float beta1, float beta2, float eps, float weight_decay, bool adamw, bool bias_correction,
            float grad_scale, bool check_finite, bool maximize) {
    const std::size_t count = params.size();
    if (exp_avgs.size() != count || exp_avg_sqs.size() != count || grads.size() != count ||
        (!outs.empty() && outs.size() != count)) {
      throw std::invalid_argument("CpuAdam.step: params, exp_avgs, exp_avg_sqs, grads (and outs) need equal lengths");
    }
    std::vector<AdamTensor> tensors(count);
    for (std::size_t i = 0; i < count; ++i) {
      const std::string where = "tensor " + std::to_string(i);
      AdamTensor& t = tensors[i];
      t.n = params[i].size();
      if (exp_avgs[i].size() != t.n || exp_avg_sqs[i].size() != t.n || grads[i].size() != t.n) {
        throw std::invalid_argument(where + ": param, exp_avg, exp_avg_sq and grad must have the same size");
      }
      t.param = memory_of(params[i], where + " param");
      t.exp_avg = memory_of(exp_avgs[i], where + " exp_avg");
      t.exp_avg_sq = memory_of(exp_avg_sqs[i], where + " exp_avg_sq");
      t.grad = memory_of(grads[i], where + " grad");
      t.grad_dtype = dtype_of(grads[i], (where + " grad").c_str());
      if (!outs.empty() && outs[i]) {
        CpuArray& out = *outs[i];
        if (out.size() != t.n) throw std::invalid_argument(where + ": out must have the same size as param");
        t.out = memory_of(out, where + " out");
        t.out_dtype = dtype_of(out, (where + " out").c_str());
        if (t.out_dtype == DType::f32) throw std::invalid_argument(where + ": out must be float16 or bfloat16");
      }
    }
    StepOptions o;
    o.step = step;
    o.grad_scale = grad_scale;
    o.check_finite = check_finite;
    const AdamHyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, maximize);
    Status s;
    {
      nb::gil_scoped_release release;
      s = adam.step(h, o, tensors);
    }
    check(s);
  }
};

}  // namespace

void bind_cpu_adam(nb::module_& m) {
  nb::class_<PyCpuAdam>(m, "CpuAdam", "Multi-tensor CPU Adam/AdamW on fp32 master weights and moments.")
      .def("__init__",
           [](PyCpuAdam* self, const nb::str& isa, nb::handle threads, nb::handle tile) {
             CpuAdamOptions o;
             o.isa = utf8_arg(isa, "CpuAdam: isa");
             o.threads = int_arg<int>(threads, "CpuAdam: threads");
             o.tile = int_arg<std::size_t>(tile, "CpuAdam: tile");
             new (self) PyCpuAdam{take(CpuAdam::create(o))};
           },
           nb::arg("isa") = "auto", nb::arg("threads") = 0, nb::arg("tile") = std::size_t{1} << 16)
      // noconvert on what is written: nanobind would otherwise step a contiguous float32 copy of a strided or
      // float64 array and drop it, leaving the caller's array as it was.
      .def("step", &PyCpuAdam::step, nb::arg("params").noconvert(), nb::arg("exp_avgs").noconvert(),
           nb::arg("exp_avg_sqs").noconvert(), nb::arg("grads"),
           nb::arg("outs").noconvert() = std::vector<std::optional<CpuArray>>{}, nb::kw_only(),
           nb::arg("step"), nb::arg("lr") = 1e-3f, nb::arg("beta1") = 0.9f, nb::arg("beta2") = 0.999f,
           nb::arg("eps") = 1e-8f, nb::arg("weight_decay") = 0.0f, nb::arg("adamw") = true,
           nb::arg("bias_correction") = true, nb::arg("grad_scale") = 1.0f, nb::arg("check_finite") = false,
           nb::arg("maximize") = false,
           "Steps every tensor in place; `outs` (optional, one per tensor) receive the weights as fp16/bf16.")
      .def_prop_ro("isa", [](const PyCpuAdam& a) { return std::string(isa_name(a.adam.isa())); })
      .def_prop_ro("kernel", [](const PyCpuAdam& a) { return std::string(a.adam.kernel()); })
      .def_prop_ro("threads", [](const PyCpuAdam& a) { return a.adam.threads(); })
      .def_prop_ro("tile", [](const PyCpuAdam& a) { return a.adam.tile(); });
}

}  // namespace zoe::python
