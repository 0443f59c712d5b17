"""A pytest plugin that puts zoe's ``OffloadOptimizer`` into PyTorch's optimizer test database.

PyTorch's ``test/test_optim.py`` (``TestOptimRenewed``) parametrizes its tests over
``torch.testing._internal.common_optimizers.optim_db`` when the module is imported, through
``@optims(optim_db, ...)``. This plugin is loaded with ``-p zoe_optim_info`` (see scripts/torch-optim-suite),
so it runs before pytest imports the test file: it appends an ``OptimizerInfo`` for
``zoe.torch.OffloadOptimizer`` to that list, and the suite's tests are generated for zoe as for any
optimizer of torch's, named ``..._OffloadOptimizer_cpu_float32``.

The entry is derived from torch.optim.AdamW's entry, looked up in ``optim_db`` at run time (its inputs, error
inputs, LR schedulers, decorators and flags are used by reference, not copied), restricted to what zoe
supports:

* the CPU device (tests instantiated for other devices are skipped);
* float32 and bfloat16 parameters (float16 would switch on zoe's dynamic loss scaling, which AdamW does not
  have; float64 and complex are not supported);
* no amsgrad, maximize, capturable, differentiable, foreach or fused configurations, no sparse gradients,
  no complex parameters, no parameters on several devices.

Environment:
    ZOE_TORCH_SUITE_TEST_DIR  the folder of test_optim.py. Any of its sibling modules
                              ``optim/test_lrscheduler.py``, ``optim/test_optim.py``, ``optim/test_swa_utils.py``
                              (imported by test_optim.py, not installed with torch) that is missing there is
                              replaced by an empty stand-in, whose test classes have no tests.
    ZOE_TORCH_SUITE_ALL=1     keep every collected test (by default only those parametrized for zoe run).
"""
from __future__ import annotations

import inspect
import os
import sys
import types
import unittest

import torch
from torch.testing._internal import common_optimizers
from torch.testing._internal.common_methods_invocations import DecorateInfo

import zoe.torch

OPTIM_CLS = zoe.torch.OffloadOptimizer
NAME = OPTIM_CLS.__name__

# Flags of AdamW's configurations that zoe does not have: a configuration setting any of them to a true
# value is left out.
UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused")
SUPPORTED_DEVICE_TYPES = ("cpu",)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def _reference_info():
    for info in common_optimizers.optim_db:
        if info.optim_cls is torch.optim.AdamW:
            return info
    raise RuntimeError("torch.testing._internal.common_optimizers.optim_db has no entry for torch.optim.AdamW")


def _supported(optim_input) -> bool:
    kwargs = optim_input.kwargs or {}
    return not any(bool(kwargs.get(flag, False)) for flag in UNSUPPORTED_FLAGS)


def _device_type(device) -> str:
    return str(device.type if isinstance(device, torch.device) else device).split(":")[0]


class _SkipWhen(DecorateInfo):
    """Skips every test of the zoe entry for which ``predicate(device_type, dtype)`` holds."""

    def __init__(self, predicate, reason: str):
        super().__init__(unittest.skip(reason))
        self._predicate = predicate

    def is_active(self, cls_name, test_name, device_type, dtype, param_kwargs):
        return self._predicate(device_type, dtype)


def build_optim_info(reference):
    def optim_inputs_func(device, dtype=None):
        return [i for i in reference.optim_inputs_func(device, dtype) if _supported(i)]

    error_inputs_func = None
    if reference.optim_error_inputs_func is not None:
        def error_inputs_func(device, dtype):
            return [e for e in reference.optim_error_inputs_func(device, dtype)
                    if _supported(e.optimizer_error_input)]

    skips = (
        _SkipWhen(lambda device_type, dtype: device_type not in SUPPORTED_DEVICE_TYPES,
                  f"zoe {NAME}: this suite runs it on the CPU only"),
        _SkipWhen(lambda device_type, dtype: dtype is not None and dtype not in SUPPORTED_DTYPES,
                  f"zoe {NAME}: parameter dtypes other than float32/bfloat16 are out of scope"),
    )
    kwargs = dict(
        optim_inputs_func=optim_inputs_func,
        optim_error_inputs_func=error_inputs_func,
        scheduler_inputs=reference.scheduler_inputs,
        supported_impls=(),  # zoe has no foreach / fused / differentiable implementations
        not_og_supported_flags=reference.not_og_supported_flags,
        supports_sparse=False,
        has_capturable_arg=False,
        only_supports_sparse_grads=False,
        supports_complex=False,
        step_requires_closure=False,
        supports_param_groups=True,
        supports_multiple_devices=False,
        supports_fused_on=(),
        decorators=tuple(reference.decorators),  # AdamW's (already merged with its skips by OptimizerInfo)
        skips=skips,
    )
    accepted = inspect.signature(common_optimizers.OptimizerInfo.__init__).parameters
    return common_optimizers.OptimizerInfo(OPTIM_CLS, **{k: v for k, v in kwargs.items() if k in accepted})


def register() -> None:
    db = common_optimizers.optim_db
    if any(info.optim_cls is OPTIM_CLS for info in db):
        return
    db.append(build_optim_info(_reference_info()))


def _install_sibling_stand_ins() -> list[str]:
    """test_optim.py imports three modules from PyTorch's test folder; stand in for those that are absent."""
    test_dir = os.environ.get("ZOE_TORCH_SUITE_TEST_DIR")
    if not test_dir:
        return []
    from torch.testing._internal.common_utils import TestCase

    wanted = {"test_lrscheduler": "TestLRScheduler", "test_optim": "TestDifferentiableOptimizer",
              "test_swa_utils": "TestSWAUtils"}
    package_dir = os.path.join(test_dir, "optim")
    missing = [m for m in wanted if not os.path.isfile(os.path.join(package_dir, m + ".py"))]
    if not missing or "optim" in sys.modules:
        return []
    package = types.ModuleType("optim")
    package.__path__ = [package_dir] if os.path.isdir(package_dir) else []
    sys.modules["optim"] = package
    for module_name in missing:
        module = types.ModuleType(f"optim.{module_name}")
        module.__doc__ = "zoe torch-optim-suite: a stand-in with no tests for PyTorch's module of this name."
        cls = type(wanted[module_name], (TestCase,), {"__module__": module.__name__})
        setattr(module, wanted[module_name], cls)
        sys.modules[module.__name__] = module
        setattr(package, module_name, module)
    return [f"optim/{m}.py" for m in missing]


register()
_STAND_INS = _install_sibling_stand_ins()


def pytest_report_header(config):
    lines = [f"zoe torch-optim-suite: torch {torch.__version__}; {NAME} registered in optim_db "
             f"(from AdamW's entry; CPU, float32/bfloat16; no {'/'.join(UNSUPPORTED_FLAGS)})"]
    if _STAND_INS:
        lines.append("zoe torch-optim-suite: empty stand-ins for " + ", ".join(_STAND_INS))
    return lines


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ZOE_TORCH_SUITE_ALL") == "1":
        return
    keep, drop = [], []
    for item in items:
        (keep if f"_{NAME}_" in item.name or item.name.endswith(f"_{NAME}") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
