"""A zoe checkpoint whose checksums are all valid but whose manifest lies (issue 49): a parameter recorded with
the shape [2**40, 2**40] over its 4096 elements was taken by load_state_dict (and then exported as a
safetensors header no reader accepts). It is refused, naming the parameter and the shape, and the optimizer
is left as it was: its weights, moments, step and param groups."""
import json
import os
import struct
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import batches, make_mlp, train  # noqa: E402


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _rewrite_manifest(path, edit) -> None:
    """The checkpoint at ``path`` with its manifest (JSON) passed through ``edit``, index and trailer checksums
    made valid again (the format is described at the top of src/offload/checkpoint.cpp)."""
    with open(path, "rb") as f:
        data = f.read()
    trailer = data[-40:]
    index_offset, index_size = struct.unpack_from("<QQ", trailer, 0)
    index = data[index_offset:index_offset + index_size]
    at = 4
    for _ in range(struct.unpack_from("<I", index, 0)[0]):
        (name_len,) = struct.unpack_from("<I", index, at)
        at += 4 + name_len + 20
    manifest = json.loads(index[at + 8:])
    edit(manifest)
    text = json.dumps(manifest).encode()
    index = index[:at] + struct.pack("<Q", len(text)) + text
    head = struct.pack("<QQI", index_offset, len(index), _crc32c(index)) + trailer[20:28]
    trailer = head + struct.pack("<I", _crc32c(head)) + b"ZOEINDX\0"
    with open(path, "wb") as f:
        f.write(data[:index_offset] + index + trailer)


def test_crc32c_check_value():
    assert _crc32c(b"123456789") == 0xE3069283


def _snapshot(model, opt):
    sd = opt.torch_state_dict()
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "masters": {k: v.clone() for k, v in sd["zoe_masters"].items()},
        "moments": {k: (v["exp_avg"].clone(), v["exp_avg_sq"].clone()) for k, v in sd["state"].items()},
        "step": opt.step_count,
        "lr": [g["lr"] for g in opt.param_groups],
    }


def _assert_same(a, b):
    assert a["step"] == b["step"] and a["lr"] == b["lr"]
    for x, y in zip(a["weights"], b["weights"]):
        assert torch.equal(x, y)
    for k in a["masters"]:
        assert torch.equal(a["masters"][k], b["masters"][k])
    for k in a["moments"]:
        assert all(torch.equal(x, y) for x, y in zip(a["moments"][k], b["moments"][k]))


@pytest.mark.parametrize("shape, words", [
    ([2**40, 2**40], "its shape [1099511627776, 1099511627776] holds more than 2^64 elements, and it has 2048"),
    ([2**32, 2**32 + 1], "holds more than 2^64 elements"),
    ([32, 32], "its shape [32, 32] holds 1024 elements, and it has 2048"),
])
def test_load_state_dict_refuses_a_shape_that_does_not_hold_its_elements(tmp_path, shape, words):
    from zoe.torch import OffloadOptimizer

    model = make_mlp(seed=4)
    opt = OffloadOptimizer(model.parameters(), lr=1e-3)
    data = batches(3)
    train(model, opt, data[:2])
    opt.save_to(tmp_path / "ckpt")
    sd = opt.state_dict()  # refers to the rank file just written
    train(model, opt, data[2:])  # the state to keep moves on from the saved one
    opt.param_groups[0]["lr"] = 5e-4
    before = _snapshot(model, opt)

    def crafted(manifest):
        p = manifest["params"][0]  # the first Linear's weight: 64 x 32
        assert p["n"] == 2048 and p["shape"] == [64, 32]
        p["shape"] = shape

    _rewrite_manifest(str(tmp_path / "ckpt" / "zoe" / "rank0-of-1.zoe"), crafted)
    with pytest.raises(Exception) as refused:
        opt.load_state_dict(sd)
    message = str(refused.value)
    assert "parameter 0" in message and words in message, message
    _assert_same(before, _snapshot(model, opt))


def test_consolidate_refuses_a_layout_shape_that_is_not_a_shape():
    from zoe.torch import OffloadOptimizer, consolidate_state_dicts

    model = make_mlp(seed=5)
    opt = OffloadOptimizer(model.parameters(), lr=1e-3)
    train(model, opt, batches(1))
    sd = opt.state_dict()
    sd["zoe"]["layout"][0][0] = [64, -32]
    with pytest.raises(ValueError, match=r"parameter 0 of the state_dicts' layout: its shape \[64, -32\] has a "
                                         r"dimension that is not a non-negative integer"):
        consolidate_state_dicts([sd])
