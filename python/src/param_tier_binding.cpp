// zoe._zoe's ParamTier: blocks of 16-bit weights off the device, fetched into a device pool, with addresses as
// integers for the PyTorch hooks (zoe/_param_offload.py).
#include "python/src/binding.h"

namespace zoe::python {
namespace {

void bind_param_tier_create(nb::class_<PyParamTier>& tier) {
  tier.def("__init__",
           [](PyParamTier* self, nb::object device_obj, std::vector<std::vector<std::size_t>> entry_bytes,
              std::vector<std::string> names, const std::string& home, std::vector<std::string> nvme_paths,
              std::size_t budget_bytes, int prefetch, bool host_consumer, bool keep_files) {
             ParamTierOptions o;
             o.host_consumer = host_consumer;
             o.keep_files = keep_files;
             o.home = take(parse_param_home(home));
             o.nvme_paths = std::move(nvme_paths);
             o.budget_bytes = budget_bytes;
             o.prefetch = prefetch;
             std::vector<ParamBlockSpec> blocks;
             for (std::size_t b = 0; b < entry_bytes.size(); ++b) {
               blocks.push_back({b < names.size() ? names[b] : std::string(), std::move(entry_bytes[b])});
             }
             Device& device = *nb::cast<PyDevice&>(device_obj).device;
             Result<ParamTier> made = Status(StatusCode::internal, "not created");
             {
               nb::gil_scoped_release release;
               made = ParamTier::create(device, std::move(blocks), o);
             }
             new (self) PyParamTier{device_obj, take(std::move(made))};
           },
           nb::arg("device"), nb::arg("entry_bytes"), nb::arg("names"), nb::arg("home") = "cpu",
           nb::arg("nvme_paths") = std::vector<std::string>{}, nb::arg("budget_bytes") = 0, nb::arg("prefetch") = 2,
           nb::arg("host_consumer") = false, nb::arg("keep_files") = false);
}

// Entries written and read, blocks fetched and released.
void bind_param_tier_io(nb::class_<PyParamTier>& tier) {
  // The bytes are the array's own: a pointer and a size from Python could disagree with the memory behind them.
  tier.def("write",
           [](PyParamTier& t, std::size_t block, std::size_t entry, const CpuArray& data, std::size_t byte_offset) {
             const void* from = memory_of(data, "ParamTier.write");
             check(t.call([&](ParamTier& p) { return p.write(block, entry, from, byte_offset, data.nbytes()); }));
           },
           nb::arg("block"), nb::arg("entry"), nb::arg("data"), nb::arg("byte_offset") = 0,
           "Copies the elements of `data` (a host array; a strided one is copied contiguous first) into the "
           "entry's home from byte_offset on.")
      .def("read",
           [](PyParamTier& t, std::size_t block, std::size_t entry, CpuArray out, std::size_t byte_offset) {
             void* to = memory_of(out, "ParamTier.read");
             check(t.call([&](ParamTier& p) { return p.read(block, entry, to, byte_offset, out.nbytes()); }));
           },
           // noconvert: a contiguous copy made of a strided `out` would be filled and dropped.
           nb::arg("block"), nb::arg("entry"), nb::arg("out").noconvert(), nb::arg("byte_offset") = 0,
           "Fills `out` (a contiguous host array) with the entry's bytes from byte_offset on.")
      .def("set_order", [](PyParamTier& t, std::vector<std::size_t> order) { check(t.get().set_order(std::move(order))); })
      .def("fetch",
           [](PyParamTier& t, std::size_t block, bool backward) {
             Result<void*> r = t.call([&](ParamTier& p) { return p.fetch(block, backward); });
             return reinterpret_cast<std::uintptr_t>(take(std::move(r)));
           },
           nb::arg("block"), nb::arg("backward") = false,
           "The block's device address, valid for work after this call until release(); prefetches ahead.")
      .def("release", [](PyParamTier& t, std::size_t block) { check(t.call([&](ParamTier& p) { return p.release(block); })); })
      .def("prefetch", [](PyParamTier& t, std::size_t block) { check(t.call([&](ParamTier& p) { return p.prefetch(block); })); })
      .def("synchronize", [](PyParamTier& t) { check(t.call([](ParamTier& p) { return p.synchronize(); })); });
}

// The layout, the users, close and the counters.
void bind_param_tier_queries(nb::class_<PyParamTier>& tier) {
  tier.def("entry_offset", [](PyParamTier& t, std::size_t b, std::size_t e) { return t.get().entry_offset(b, e); })
      .def("in_use", [](PyParamTier& t, std::size_t b) { return t.get().in_use(b); })
      .def("blocks", [](PyParamTier& t) { return t.get().blocks(); })
      .def("block_bytes", [](PyParamTier& t, std::size_t b) { return t.get().block_bytes(b); })
      .def("files", [](PyParamTier& t) { return t.get().files(); })
      .def("close", [](PyParamTier& t) {
        if (t.engines > 0) {
          throw std::invalid_argument("the parameter tier cannot be closed: " + std::to_string(t.engines) +
                                      " optimizer(s) still write into it (delete them first)");
        }
        nb::gil_scoped_release release;
        t.tier.reset();
      }, "Frees the pool and the home (an NVMe file is removed unless keep_files); every later call raises.")
      .def("remove_files", [](PyParamTier& t) {
        // A closed tier removed its files already (or kept them, as asked).
        if (t.tier) check(t.tier->remove_files());
      }, "NVMe: removes the home files' names now; the tier goes on working on the open files, whose room is "
         "freed when it is destroyed. For exits that cannot wait for the tier's users.")
      .def_prop_ro("users", [](PyParamTier& t) { return t.engines; }, "Optimizers writing into this tier.")
      .def("stats", [](PyParamTier& t) {
        const ParamTierStats s = t.get().stats();
        nb::dict d;
        d["budget_bytes"] = s.budget_bytes;
        d["pool_peak_bytes"] = s.pool_peak_bytes;
        d["fetches"] = s.fetches;
        d["hits"] = s.hits;
        d["loads"] = s.loads;
        d["evictions"] = s.evictions;
        d["loaded_bytes"] = s.loaded_bytes;
        d["fetch_wait_s"] = s.fetch_wait_s;
        d["read_bytes"] = s.read_bytes;
        d["write_bytes"] = s.write_bytes;
        d["read_busy_s"] = s.read_busy_s;
        d["write_busy_s"] = s.write_busy_s;
        return d;
      });
}

}  // namespace

void bind_param_tier(nb::module_& m) {
  // Tests only (zoe/space.h): the free RAM and disk every check before allocating compares with, so that a
  // refusal is tested without the machine's own figures; None for both gives them back.
  m.def("set_free_space_for_tests",
        [](std::optional<std::uint64_t> ram, std::optional<std::uint64_t> disk) {
          if (!ram && !disk) {
            set_free_space_override(std::nullopt);
          } else {
            set_free_space_override(FreeSpaceOverride{ram, disk});
          }
        },
        nb::arg("ram") = nb::none(), nb::arg("disk") = nb::none());
  nb::class_<PyParamTier> tier(m, "ParamTier",
                               "Blocks of 16-bit weights off the device (pinned RAM or NVMe), fetched into a bounded "
                               "device pool with prefetch (zoe/param_tier.h).");
  bind_param_tier_create(tier);
  bind_param_tier_io(tier);
  bind_param_tier_queries(tier);
}

}  // namespace zoe::python
