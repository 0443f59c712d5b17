"""Bounded fuzzing of the readers users feed by hand, as they reach them (issue 32): `zoe plan --model` as a
process, and the DeepSpeed config through Python (zoe.parse_config, zoe.load_config, and what they give
built into an engine). Mutated inputs from a fixed seed, a few seconds each. Whatever the input, the process
must exit with zoe's one-line error (never a signal), and Python must see a result or one of zoe's error
classes — never a crash, a UnicodeDecodeError or a TypeError from the binding layer. A failing case is
replayed alone with ZOE_FUZZ_CASE=<i>.

tests/plan/test_fuzz_model_config.cpp and tests/offload/test_fuzz_readers.cpp fuzz the same readers in C++
with many more cases; these cover the boundaries (CLI main, nanobind) the C++ suites cannot see."""
import copy
import json
import os
import pathlib
import random
import subprocess

import numpy as np
import pytest

import zoe

ZOE = pathlib.Path(__file__).resolve().parents[2] / "build" / "zoe"
SEED = 0x5eed2032
CASES = int(os.environ.get("ZOE_FUZZ_CASES", "250"))
ONLY = os.environ.get("ZOE_FUZZ_CASE")

# Values that sit on the edges of what the readers check: other JSON types, integer and float limits,
# non-ASCII text.
EDGE_VALUES = [0, 1, -1, 7, 0.5, 1e-300, 1e308, 2**31, 2**63 - 1, 2**63, 2**64, -2**63, True, False, None, "",
               "x", "auto", "\u00e9t\u00e9", "a\udc80", "\u65e5\u672c", "\U0001F600", [], {}, [1, 2], {"a": 1},
               [0.9, 0.999], float("inf"), float("nan")]
# Inserted into the text: a syntax error next to a multi-byte character is where a cut UTF-8 sequence
# once reached the message.
# A lone surrogate is valid in a Python str but not in UTF-8: in a file (written with surrogatepass) it is
# three bytes no UTF-8 decoder takes, in parse_config's text an argument zoe must refuse by name.
TEXT_NOISE = ["\u00e9", "\u65e5", "\U0001F600", "\ud800", "{", "}", "[", "]", ",", ":", '"', "\\", "0", "-", "e", " "]


def _nodes(doc, path=()):
    yield path
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, path + (i,))


def _set(doc, path, value):
    if not path:
        return value
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


def mutate(valid: dict, rng: random.Random) -> tuple[str, str]:
    """1 to 3 edits of `valid`'s JSON text: values replaced by edge values or other subtrees, members
    removed, then text edits (characters inserted, deleted, the text cut). Returns (text, what was done)."""
    doc = copy.deepcopy(valid)
    done = []
    for _ in range(rng.randint(1, 3)):
        paths = list(_nodes(doc))
        kind = rng.randrange(6)
        if kind <= 2:
            path = rng.choice(paths)
            value = rng.choice(EDGE_VALUES) if kind < 2 else copy.deepcopy(rng.choice(
                [_get(doc, p) for p in paths]))
            doc = _set(doc, path, value)
            done.append(f"{'/'.join(map(str, path))} = {value!r}"[:80])
        elif kind == 3:
            members = [p for p in paths if p and isinstance(_get(doc, p[:-1]), dict)]
            if members:
                path = rng.choice(members)
                del _get(doc, path[:-1])[path[-1]]
                done.append(f"{'/'.join(map(str, path))} removed")
        else:
            text = json.dumps(doc, ensure_ascii=rng.random() < 0.5)
            at = rng.randrange(len(text) + 1)
            if kind == 4:
                noise = rng.choice(TEXT_NOISE)
                text = text[:at] + noise + text[at:]
                done.append(f"{noise!r} inserted at {at}")
            else:
                text = text[:at] + text[at + rng.randint(1, 8):] if rng.random() < 0.5 else text[:at]
                done.append(f"text cut at {at}")
            return text, "; ".join(done)  # no longer a document: the last edit
    return json.dumps(doc, ensure_ascii=rng.random() < 0.5), "; ".join(done)


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def cases():
    return [int(ONLY)] if ONLY is not None else range(CASES)


# ---- zoe plan --model ----

VALID_MODEL = {"model_type": "mixtral", "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 704,
               "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 32000,
               "hidden_act": "silu", "activation_function": "gelu_new", "attention_bias": False,
               "tie_word_embeddings": False, "n_positions": None, "num_local_experts": 8, "torch_dtype": "bfloat16"}


@pytest.mark.skipif(not ZOE.exists(), reason=f"{ZOE} is not built (run scripts/build)")
def test_zoe_plan_model_never_crashes(tmp_path):
    config = tmp_path / "config.json"
    outcomes = {"accepted": 0, "refused": 0}
    for i in cases():
        text, what = mutate(VALID_MODEL, random.Random(SEED + i))
        config.write_bytes(text.encode("utf-8", "surrogatepass"))
        r = subprocess.run([str(ZOE), "plan", "--model", str(config), "--adam-rate", "1B", "--json"],
                           capture_output=True, timeout=60)
        where = f"case {i} ({what}; replay: ZOE_FUZZ_CASE={i}):\n{text[:400]}"
        assert r.returncode in (0, 2), f"{where}\nexit status {r.returncode}, stderr: {r.stderr[-600:]!r}"
        err = r.stderr.decode("utf-8")  # raises on a cut UTF-8 sequence
        if r.returncode == 0:
            outcomes["accepted"] += 1
            assert json.loads(r.stdout)["params"] > 0, where
        else:
            outcomes["refused"] += 1
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"zoe plan: {config}"), f"{where}\n{err}"
    print(f"zoe plan --model: {len(cases())} cases (seed {SEED:#x}): {outcomes}")
    if ONLY is None:
        assert outcomes["accepted"] > 0 and outcomes["refused"] > 0, outcomes


# ---- the DeepSpeed config through Python ----

VALID_DEEPSPEED = {
    "train_batch_size": 16, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                 "warmup_num_steps": 100}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 4},
                          "offload_param": {"device": "cpu", "buffer_count": 5, "buffer_size": 1e8}},
    "aio": {"block_size": 1048576, "queue_depth": 8},
    "zoe": {"schedule": "sync", "delayed_warmup_steps": 10, "tile": 4096, "threads": 1, "isa": "auto"},
}


def engine_from_config(cfg: dict):
    """What a user builds from zoe.load_config's result: EngineOptions by the names it gives, one group of
    its hyper-parameters, then one step over a small fp32 parameter whose gradient is finite."""
    opts = zoe.EngineOptions()
    for name, value in cfg["options"].items():
        setattr(opts, name, value)
    opts.tier, opts.nvme_paths = "ram", []  # the fuzz writes no swap files, wherever the config points
    w = np.linspace(-1, 1, 64, dtype=np.float32)
    g = np.full(64, 1e-3, dtype=np.float32)
    params = [(w.size, "f32", w, g, 0, "w", [w.size])]
    engine = zoe.Engine(zoe.host_device(), [dict(cfg["hyper"])], params, opts)
    engine.step()
    engine.wait()
    return engine


def test_deepspeed_config_through_python_raises_only_zoe_errors(tmp_path):
    assert not engine_from_config(zoe.parse_config(json.dumps(VALID_DEEPSPEED))).last_step_skipped
    path = tmp_path / "ds.json"
    outcomes = {"accepted": 0, "refused": 0, "stepped": 0}
    for i in cases():
        rng = random.Random(SEED + i)
        text, what = mutate(VALID_DEEPSPEED, rng)
        where = f"case {i} ({what}; replay: ZOE_FUZZ_CASE={i}):\n{text[:400]}"
        try:
            if rng.random() < 0.5:
                cfg = zoe.parse_config(text, "ds.json")
            else:
                path.write_bytes(text.encode("utf-8", "surrogatepass"))
                cfg = zoe.load_config(str(path))
        except zoe.ZoeError as e:
            outcomes["refused"] += 1
            named = "ds.json" in str(e) or str(e).startswith("invalid argument: text: ")
            assert named, f"{where}\nan error that names neither the config nor the argument: {e}"
            continue
        except Exception as e:  # noqa: BLE001 -- any other class escaping is the failure under test
            pytest.fail(f"{where}\n{type(e).__name__} escaped: {e}")
        outcomes["accepted"] += 1
        try:
            engine = engine_from_config(cfg)
        except zoe.ZoeError:
            continue  # refused by the engine: a combination the reader cannot judge alone
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{where}\n{type(e).__name__} escaped building the engine: {e}")
        assert not engine.last_step_skipped, f"{where}\nan accepted config skips a step with finite gradients"
        outcomes["stepped"] += 1
    print(f"DeepSpeed config through Python: {len(cases())} cases (seed {SEED:#x}): {outcomes}")
    if ONLY is None:
        assert outcomes["stepped"] > 0 and outcomes["refused"] > 0, outcomes
