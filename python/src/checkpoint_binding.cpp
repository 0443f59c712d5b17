// zoe._zoe's module functions over files: a zoe checkpoint read whole or located blob by blob, a run's
// optimizer checkpoints joined (PartitionedCheckpoint), and a DeepSpeed JSON config parsed into plain Python
// values.
#include <algorithm>

#include "python/src/binding.h"
#include "zoe/config.h"
#include "zoe/checkpoint.h"

namespace zoe::python {
namespace {

// A checkpoint file opened (header, trailer and index read and checked) without the GIL.
CheckpointReader open_checkpoint(const std::string& path) {
  Result<CheckpointReader> r = Status(StatusCode::internal, "not read");
  {
    nb::gil_scoped_release release;
    r = CheckpointReader::open(path);
  }
  return take(std::move(r));
}

// The DeepSpeed JSON config as plain Python values (engine options by the names Engine takes, the Adam
// hyper-parameters, and the notes on keys zoe ignored or read differently).
nb::dict config_dict(const LoadedConfig& c) {
  nb::dict opts;
  for (const OptionField& f : option_fields()) opts[f.name.data()] = option_to_python(f.get(c.options));
  nb::dict d;
  d["options"] = opts;
  d["hyper"] = hyper_dict(c.hyper);
  d["notes"] = c.notes;
  if (c.offload_param) {
    nb::dict op;
    op["device"] = std::string(param_home_name(c.param_tier.home));
    op["nvme_path"] = c.param_tier.nvme_paths;
    op["prefetch"] = c.param_tier.prefetch;
    op["budget_bytes"] = c.param_tier.budget_bytes;
    d["offload_param"] = op;
  } else {
    d["offload_param"] = nb::none();
  }
  return d;
}

// Every rank's optimizer checkpoint of one run, joined: the run's step and loss scaler, its parameters
// ((name, shape, n) each), each file's pieces of them, and each state array's fp32 elements per parameter.
nb::dict join_checkpoints(const std::vector<std::string>& paths) {
  Result<PartitionedCheckpoint> c = Status(StatusCode::internal, "not read");
  std::vector<std::string> arrays = {"master"};  // and the run's optimizer's state arrays, by the table's names
  std::vector<std::vector<std::vector<float>>> joined;
  {
    nb::gil_scoped_release release;
    c = PartitionedCheckpoint::open(paths);
    if (c.ok()) {
      for (const std::string& state : c->state_names()) arrays.push_back(state);
    }
    for (std::size_t k = 0; c.ok() && k < arrays.size(); ++k) {
      Result<std::vector<std::vector<float>>> j = c->join(arrays[k].c_str());
      if (!j.ok()) {
        c = j.status();
        break;
      }
      joined.push_back(std::move(j).value());
    }
  }
  const PartitionedCheckpoint checkpoint = take(std::move(c));
  nb::dict d;
  d["step"] = checkpoint.step();
  const LossScaleState ls = checkpoint.loss_scale();
  d["loss_scale"] = nb::make_tuple(ls.scale, ls.clean_steps, ls.hysteresis_left);
  nb::list params, pieces;
  for (const CheckpointParam& p : checkpoint.params()) params.append(nb::make_tuple(p.name, p.shape, p.n));
  for (std::size_t f = 0; f < checkpoint.files(); ++f) {
    nb::list file;
    for (const CheckpointPiece& k : checkpoint.pieces(f)) file.append(nb::make_tuple(k.param, k.begin, k.n));
    pieces.append(file);
  }
  d["params"] = params;
  d["pieces"] = pieces;
  d["optimizer"] = std::string(optimizer_rule(checkpoint.rule()).name);
  for (std::size_t k = 0; k < joined.size(); ++k) {
    nb::list out;
    for (std::vector<float>& elements : joined[k]) {
      auto* owned = new std::vector<float>(std::move(elements));
      nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
      out.append(nb::ndarray<nb::numpy, float, nb::ndim<1>>(owned->data(), {owned->size()}, owner));
    }
    d[arrays[k].c_str()] = out;
  }
  return d;
}

}  // namespace

void bind_checkpoint_config(nb::module_& m) {
  m.def("read_checkpoint",
        [](const nb::str& path_arg) {
          const std::string path = utf8_arg(path_arg, "path");
          const CheckpointReader reader = open_checkpoint(path);
          nb::dict blobs;
          for (const std::string& name : reader.names()) {
            const std::size_t bytes = take(reader.size(name));
            auto* data = new std::uint8_t[std::max<std::size_t>(bytes, 1)];
            nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<std::uint8_t*>(p); });
            Status s;
            {
              nb::gil_scoped_release release;
              s = reader.read(name, data, bytes);
            }
            check(s);
            blobs[name.c_str()] = nb::ndarray<nb::numpy, std::uint8_t, nb::ndim<1>>(data, {bytes}, owner);
          }
          return nb::make_tuple(reader.manifest(), blobs);
        },
        nb::arg("path"),
        "A zoe checkpoint file, every blob's checksum verified: (manifest JSON text, {blob name: uint8 array}).");
  m.def("checkpoint_blobs",
        [](const nb::str& path_arg) {
          const std::string path = utf8_arg(path_arg, "path");
          const CheckpointReader reader = open_checkpoint(path);
          nb::dict blobs;
          for (const std::string& name : reader.names()) {
            blobs[name.c_str()] = nb::make_tuple(take(reader.offset(name)), take(reader.size(name)));
          }
          return blobs;
        },
        nb::arg("path"), "Where each blob of a zoe checkpoint file lies in it: {blob name: (offset, bytes)}; nothing is read.");
  m.def("join_checkpoints",
        [](const std::vector<nb::str>& path_args) {
          std::vector<std::string> paths;
          for (const nb::str& p : path_args) paths.push_back(utf8_arg(p, "paths"));
          return join_checkpoints(paths);
        },
        nb::arg("paths"),
        "Every rank's optimizer checkpoint of one run joined, as zoe export does: {step, loss_scale, params: "
        "[(name, shape, n)], pieces: [each file's [(param, begin, n)]], optimizer: its rule, master and each state "
        "array by name (exp_avg/exp_avg_sq; Lion's exp_avg; Adagrad's sum): [fp32 array per param]}.");
  m.def("optimizer_table", &optimizer_table,
        "The optimizers zoe steps: per rule its name, torch class, DeepSpeed types, defaults and state arrays.");
  m.def("parse_config",
        [](const nb::str& text, const nb::str& source) {
          return config_dict(take(parse_config(utf8_arg(text, "text"), utf8_arg(source, "source"))));
        },
        nb::arg("text"), nb::arg("source") = "<string>");
  m.def("load_config", [](const nb::str& path) { return config_dict(take(load_config_file(utf8_arg(path, "path")))); },
        nb::arg("path"));
}

}  // namespace zoe::python
