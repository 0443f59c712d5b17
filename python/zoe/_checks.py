"""Checks of the keywords the Python front ends (OffloadOptimizer, offload_parameters) hand to the C++ core.
A value nanobind cannot convert (tile=-1 into a size_t, a string with a lone surrogate into UTF-8) would
otherwise surface as nanobind's "incompatible function arguments" TypeError, which names neither the
keyword nor the value; these raise zoe's InvalidArgumentError (a ValueError) naming both."""
from __future__ import annotations

import math
import numbers
import os

from ._zoe import InvalidArgumentError

INT_MAX = 2**31 - 1  # the C++ fields behind these keywords are int


def integer(where: str, name: str, value, lo: int, hi: int) -> int:
    """An int (bool is not one) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= value <= hi:
        raise InvalidArgumentError(f"{where}: {name} = {value!r} is invalid: need an integer from {lo} to {hi}")
    return int(value)


def positive_finite(where: str, name: str, value) -> float:
    """A real number > 0 and finite: a loss scale of inf or 0 skips every step."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(f"{where}: {name} = {value!r} is invalid: need a finite number > 0")
    return float(value)


def text(where: str, name: str, value) -> str:
    """A str that UTF-8 can carry (no lone surrogates)."""
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{where}: {name} = {value!r} is invalid: need a str")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"{where}: {name} = {value!r} is invalid: {e.reason} at index {e.start} "
                                   "(a lone surrogate cannot be encoded as UTF-8)") from None
    return value


def paths(where: str, name: str, value) -> list[str]:
    """One path or a list of them (nvme_path's two forms), each as path() checks it."""
    many = [value] if isinstance(value, (str, bytes, os.PathLike)) else list(value)
    return [path(where, name, p) for p in many]


def path(where: str, name: str, value) -> str:
    """A str or os.PathLike naming a file or folder, as text() checks it."""
    try:
        value = os.fspath(value)
    except TypeError:
        raise InvalidArgumentError(f"{where}: {name} = {value!r} is invalid: need a path (str or os.PathLike)") \
            from None
    if isinstance(value, bytes):
        raise InvalidArgumentError(f"{where}: {name} = {value!r} is invalid: give the path as str")
    return text(where, name, value)


def shape_numel(where: str, shape) -> int:
    """The elements a shape read from a state_dict holds: non-negative ints, multiplied as Python ints.
    torch.Size's numel() wraps in 64 bits ([2**40, 2**40] holds "0" elements there), so a crafted layout
    could match any element count; here it is refused by name."""
    try:
        dims = list(shape)
    except TypeError:
        raise ValueError(f"{where}: its shape {shape!r} is not a list of dimensions") from None
    if any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0 for d in dims):
        raise ValueError(f"{where}: its shape {shape!r} has a dimension that is not a non-negative integer")
    return math.prod(int(d) for d in dims)
