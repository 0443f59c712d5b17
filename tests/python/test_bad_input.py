"""Bad input from Python is zoe's error naming what is wrong (issue 32, item 6): integer keywords nanobind
cannot carry, loss scales that would skip every step, strings UTF-8 cannot hold, messages cut inside a
character, a damaged checkpoint header, and C++ exceptions zoe did not expect. Nothing is changed by a
refused call."""
import math

import numpy as np
import pytest
import torch

import zoe
from zoe.torch import OffloadOptimizer, offload_parameters

from conftest import make_mlp

INT_KEYWORDS = ["growth_interval", "hysteresis", "delayed_warmup_steps", "threads", "tile", "buffer_count",
                "block_size", "queue_depth"]


@pytest.mark.parametrize("name", INT_KEYWORDS)
@pytest.mark.parametrize("value", [-1, 2**70, "4", 4.0, True])
def test_integer_keywords_are_checked_by_name(name, value):
    with pytest.raises(zoe.InvalidArgumentError, match=rf"OffloadOptimizer: {name} = {value!r} is invalid: need an "
                                                       r"integer from \d+ to \d+"):
        OffloadOptimizer(make_mlp().parameters(), **{name: value})


@pytest.mark.parametrize("name", ["initial_scale", "min_loss_scale", "loss_scale"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1.0])
def test_loss_scales_must_be_finite_and_positive(name, value):
    with pytest.raises(zoe.InvalidArgumentError, match=rf"{name} = {value!r} is invalid: need a finite number > 0"):
        OffloadOptimizer(make_mlp(dtype=torch.float16).parameters(), **{name: value})
    with pytest.raises(zoe.InvalidArgumentError, match=r"need a finite number > 0"):
        OffloadOptimizer(make_mlp().parameters(), **{name: 0.0 if name != "loss_scale" else -0.5})


def test_loss_scale_modes_still_accepted():
    for ls in (None, False, 0, "dynamic", 128, 2.0**20):
        OffloadOptimizer(make_mlp(dtype=torch.float16).parameters(), loss_scale=ls)


def test_engine_options_fields_name_themselves():
    opts = zoe.EngineOptions()
    for field in ["tile", "block_size", "buffer_count", "threads", "growth_interval"]:
        before = getattr(opts, field)
        with pytest.raises(zoe.InvalidArgumentError, match=rf"EngineOptions\.{field} = -1 is invalid: need an integer"
                                                           if field in ("tile", "block_size") else
                                                           rf"EngineOptions\.{field} = 1180591620717411303424 "):
            setattr(opts, field, -1 if field in ("tile", "block_size") else 2**70)
        assert getattr(opts, field) == before, "a refused value changes nothing"
    opts.tile = np.int64(4096)  # numpy's integers are integers
    assert opts.tile == 4096
    with pytest.raises(zoe.InvalidArgumentError, match=r"EngineOptions\.isa: the str holds a lone surrogate "
                                                       r"\(U\+D800 at index 2\)"):
        opts.isa = "av\ud800"
    with pytest.raises(zoe.InvalidArgumentError, match=r"EngineOptions\.nvme_paths"):
        opts.nvme_paths = ["/tmp/\udcff"]


def _engine(opts, groups=None):
    w = np.zeros(8, dtype=np.float32)
    g = np.ones(8, dtype=np.float32)
    params = [(8, "f32", w, g, 0, "w", [8])]
    return zoe.Engine(zoe.host_device(), groups or [dict(lr=1e-3)], params, opts), w, g


def _engine_over(weights, grads, n=8, dtype="f32"):
    return zoe.Engine(zoe.cpu_device(), [dict(lr=1e-3)], [(n, dtype, weights, grads, 0, "w", [n])],
                      zoe.EngineOptions())


@pytest.mark.parametrize("weights,grads,message", [
    (12345, torch.zeros(8), r"parameter 0 'w' weights: need a tensor or array, not int"),
    (torch.zeros(8), None, r"parameter 0 'w' gradients: need a tensor or array, not NoneType"),
    (torch.zeros(7), torch.zeros(8), r"weights: the array has 7 elements, the parameter 8"),
    (torch.zeros(8), torch.zeros(4, 4)[:, :2], r"gradients: the array is not contiguous"),
    (torch.zeros(8), torch.zeros(2, 4).t(), r"gradients: the array is not contiguous"),
    (torch.zeros(8, dtype=torch.float16), torch.zeros(8), r"weights: the array is f16, the parameter is f32"),
    (torch.zeros(8, dtype=torch.float64), torch.zeros(8), r"weights: dtype must be float32, float16 or bfloat16"),
])
def test_engine_takes_arrays_checked_against_the_parameter(weights, grads, message):
    # The engine keeps these addresses for its lifetime: anything but an array of the parameter's size and
    # dtype, contiguous, in the device's memory would have it read or write outside what it came from.
    with pytest.raises(ValueError, match=message):
        _engine_over(weights, grads)


def test_engine_holds_its_arrays_and_steps_them_in_place():
    w, g = torch.zeros(8), torch.ones(8)
    engine = _engine_over(w.view(2, 4), g)  # any shape of the parameter's elements, contiguous
    del w, g  # the engine holds the tensors: their memory is not given to the next ones
    fillers = [torch.full((8,), 7.0) for _ in range(64)]
    engine.step()
    engine.wait()
    assert all(bool((f == 7).all()) for f in fillers), "the step wrote into memory the engine had let go"
    master = np.zeros(8, dtype=np.float32)
    engine.read_state(0, master, None, None)
    assert np.allclose(master, -1e-3, rtol=1e-3), master  # Adam's first step moves each weight by lr


def test_use_compute_stream_takes_a_stream_not_an_address():
    device = zoe.host_device()
    w, g = torch.zeros(8), torch.ones(8)
    engine = zoe.Engine(device, [dict(lr=1e-3)], [(8, "f32", w, g, 0, "w", [8])], zoe.EngineOptions())
    with pytest.raises(ValueError, match=r"use_compute_stream: need a zoe._zoe.HostStream on .*, not int"):
        device.use_compute_stream(12345)  # an address that is no stream: the next enqueue would follow it
    stream = zoe._zoe.HostStream()
    device.use_compute_stream(stream)
    del stream  # held by the device while it may enqueue there
    engine.step()
    engine.wait()
    device.synchronize()
    device.use_compute_stream(None)
    assert bool((w != 0).all())


def test_set_grad_sources_takes_arrays_checked_against_the_parameter():
    w, g = torch.zeros(8), torch.zeros(8)
    engine = _engine_over(w, g)
    for bad, message in [(g.data_ptr(), "need a tensor or array, not int"),
                         (torch.zeros(9), "has 9 elements, the parameter 8"),
                         (torch.zeros(16)[::2], "not contiguous"),
                         (torch.zeros(8, dtype=torch.bfloat16), "the array is bf16, the parameter is f32")]:
        with pytest.raises(ValueError, match=rf"set_grad_sources: parameter 0 gradient: .*{message}"):
            engine.set_grad_sources([0], [bad])
    with pytest.raises(ValueError, match=r"set_grad_sources: parameter 5 does not exist \(1 parameters\)"):
        engine.set_grad_sources([5], [g])
    source = torch.full((8,), 2.0)
    engine.set_grad_sources([0], [source])
    del source  # held by the engine until replaced
    engine.step()
    engine.wait()
    master = np.zeros(8, dtype=np.float32)
    engine.read_state(0, master, None, None)
    assert np.allclose(master, -1e-3, rtol=1e-3), "the step read the new source (the old one held zeros)"


@pytest.mark.parametrize("field", ["initial_scale", "static_loss_scale", "min_scale"])
def test_engine_refuses_an_infinite_loss_scale(field):
    opts = zoe.EngineOptions()
    opts.loss_scale = True
    setattr(opts, field, math.inf)
    with pytest.raises(zoe.InvalidArgumentError, match=rf"EngineOptions\.{field} = inf is invalid"):
        _engine(opts)


def test_cpu_adam_arguments_name_themselves():
    with pytest.raises(zoe.InvalidArgumentError, match=r"CpuAdam: tile = -1 is invalid"):
        zoe.CpuAdam(tile=-1)
    with pytest.raises(zoe.InvalidArgumentError, match=r"CpuAdam: threads = 4294967296 is invalid"):
        zoe.CpuAdam(threads=2**32)


def test_lone_surrogates_are_named():
    with pytest.raises(zoe.InvalidArgumentError, match=r"^invalid argument: source: the str holds a lone surrogate"):
        zoe.parse_config("{}", "ds\ud800.json")
    with pytest.raises(zoe.InvalidArgumentError, match=r"^invalid argument: text: .*U\+DC80 at index 9"):
        zoe.parse_config('{"zoe": "\udc80"}')
    with pytest.raises(zoe.InvalidArgumentError, match=r"^invalid argument: path: "):
        zoe.load_config("/tmp/\ud800.json")
    with pytest.raises(zoe.InvalidArgumentError, match=r"^invalid argument: path: "):
        zoe._zoe.read_checkpoint("/tmp/\ud800")
    with pytest.raises(zoe.InvalidArgumentError, match=r"OffloadOptimizer: nvme_path = '/tmp/\\udcff' is invalid"):
        OffloadOptimizer(make_mlp(dtype=torch.float16).parameters(), tier="nvme", nvme_path="/tmp/\udcff")
    with pytest.raises(zoe.InvalidArgumentError, match=r"offload_parameters: nvme_path = '/tmp/\\udcff' is invalid"):
        offload_parameters(make_mlp(), device="nvme", nvme_path=["/tmp/\udcff"])
    opt = OffloadOptimizer(make_mlp().parameters())
    for method, name in [(opt.save_checkpoint, "path"), (opt.save_to, "folder"), (opt.load_from, "folder")]:
        with pytest.raises(zoe.InvalidArgumentError, match=rf"{method.__name__}: {name} = '/tmp/zoe-\\ud800' is "
                                                           "invalid: surrogates not allowed at index 9"):
            method("/tmp/zoe-\ud800")
    # The engine's own binding, as any caller reaches it.
    with pytest.raises(zoe.InvalidArgumentError, match=r"^invalid argument: path: .*U\+D800 at index 9"):
        opt._engine.save("/tmp/zoe-\ud800")


def test_offload_parameters_integers_are_checked_by_name():
    with pytest.raises(zoe.InvalidArgumentError, match=r"offload_parameters: prefetch = -1 is invalid"):
        offload_parameters(make_mlp(), prefetch=-1)
    with pytest.raises(zoe.InvalidArgumentError, match=r"offload_parameters: budget_bytes = '1G' is invalid"):
        offload_parameters(make_mlp(), budget_bytes="1G")


@pytest.mark.parametrize("text", ['{"zoe": t\u00e9}', '{"zoe": \u00e9}', '{"optimizer": {"type": "Adam\U0001F600" ]}'])
def test_a_syntax_error_next_to_non_ascii_is_zoes_error(text, tmp_path):
    with pytest.raises(zoe.InvalidArgumentError, match=r"ds\.json is not valid JSON"):
        zoe.parse_config(text, "ds.json")
    # Bytes that are not UTF-8 at all, from a file: shown escaped.
    path = tmp_path / "ds.json"
    path.write_bytes(b'{"zoe": \xff}')
    with pytest.raises(zoe.InvalidArgumentError, match=r"ds\.json is not valid JSON.*\\xFF"):
        zoe.load_config(str(path))


def test_a_damaged_checkpoint_header_is_corrupt_not_newer(tmp_path):
    opt = OffloadOptimizer(make_mlp().parameters())
    path = tmp_path / "opt.zoe"
    opt.save_checkpoint(str(path))
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # the byte: the major version read as 16711681
    path.write_bytes(bytes(data))
    with pytest.raises(zoe.CorruptError, match=rf"checkpoint {path}.*header is damaged") as info:
        zoe._zoe.read_checkpoint(str(path))
    assert "newer zoe" not in str(info.value)


def test_unexpected_cpp_exceptions_become_zoe_errors():
    opts = zoe.EngineOptions()
    engine, _, _ = _engine(opts)
    # A group index past the end reaches std::vector::at: std::out_of_range, formerly Python's IndexError.
    with pytest.raises(zoe.InvalidArgumentError, match=r"invalid argument: .*"):
        engine.hyper(5)
    with pytest.raises(zoe.InvalidArgumentError, match=r"group 0: lr = 'x' is invalid: need a number"):
        _engine(zoe.EngineOptions(), groups=[dict(lr="x")])
    with pytest.raises(zoe.InvalidArgumentError, match=r"group 0: adamw = 1 is invalid: need True or False"):
        _engine(zoe.EngineOptions(), groups=[dict(adamw=1)])
    assert issubclass(zoe.OutOfMemoryError, zoe.ZoeError) and issubclass(zoe.OutOfMemoryError, MemoryError)


def test_engine_options_are_the_option_table():
    """EngineOptions has a property per field of the C++ table and nothing else of its own; the parsed config's
    options name the same fields, and each value set through them reads back as set."""
    names = zoe.EngineOptions.names()
    assert len(names) == len(set(names)) > 20
    config = zoe.parse_config("{}")["options"]
    assert list(config) == names
    opts = zoe.EngineOptions()
    for name in names:
        assert getattr(opts, name) == config[name], name
        setattr(opts, name, config[name])
    opts.schedule, opts.threads, opts.nvme_paths = "overlap", 2, ["/a", "/b"]
    assert (opts.schedule, opts.threads, opts.nvme_paths) == ("overlap", 2, ["/a", "/b"])
    with pytest.raises(zoe.InvalidArgumentError,
                       match=r"EngineOptions\.refuse_non_finite = 1 is invalid: need True or False"):
        opts.refuse_non_finite = 1
    with pytest.raises(zoe.InvalidArgumentError,
                       match=r"EngineOptions\.nvme_paths = '/a' is invalid: need a list of str"):
        opts.nvme_paths = "/a"
    opts.schedule = "eager"  # a choice is checked when an engine is made from the options, as every value is
    with pytest.raises(zoe.InvalidArgumentError, match=r"EngineOptions\.schedule: schedule 'eager' is unknown"):
        _engine(opts)
