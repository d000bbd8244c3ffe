"""A weight's GGML type id, known only when a kernel runs, made a compile-time literal.

The block formats' vector code (`vectors.py`, `blocks.py`) is generated for one format at a
time, from a literal type id; a weight's format comes from its file. `format_switch` turns
a kernel that takes the literal into one that takes the id as a value: a chain of compiled
branches, one per format of `formats.FORMATS`, each calling the kernel with its id as a
constant (a closure's constant is a literal to Numba; a value passed through ``*args`` is
not, hence one tuple of arguments).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numba import njit

from pagedkv.runtime.quant.formats import FORMATS_BY_TYPE


def format_switch(kernel: Callable[..., Any]) -> Any:
    """A compiled ``call(type_id, args)`` that returns ``kernel(literal id, args)`` for the
    format whose id equals type_id. kernel: compiled (or an overload) for a literal id; an
    id that is no format's runs the last format's code: ids are checked when the weight is
    loaded (`QuantPart`)."""
    *ids, last = sorted(FORMATS_BY_TYPE)

    @njit(inline="always")
    def otherwise(type_id, args):  # type: ignore[no-untyped-def]  # pragma: no cover
        return kernel(last, args)

    call = otherwise
    for type_id in reversed(ids):
        call = _branch(type_id, kernel, call)
    return call


def _branch(value: int, kernel: Callable[..., Any], otherwise: Any) -> Any:
    @njit(inline="always")
    def branch(type_id, args):  # type: ignore[no-untyped-def]  # pragma: no cover
        if type_id == value:
            return kernel(value, args)
        return otherwise(type_id, args)

    return branch
