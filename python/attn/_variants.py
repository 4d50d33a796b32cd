"""The attention variants' keyword arguments (docs/variants.md), turned into
the extension's keywords once for every call that takes them:
window_size=(left, right), softcap, chunk_size, alibi_slopes (H), sinks (H),
position_offset.

Conversion only: the library checks the values (window sides >= -1, a
finite softcap >= 0, one finite slope and one sink per query head, ...) and
its ValueError names the function and the argument. What is refused here is
what cannot be converted at all: the extension takes the window's sides,
the offset and the chunk size as integers, softcap as a float, and the
per-head values as a 1-D float array."""

from __future__ import annotations

import operator
from typing import Any, Dict, Optional

import numpy as np

from ._arrays import to_numpy, widen_half


def _integer(x: Any, fn: str, name: str, expected: str) -> int:
    """x as a Python int (bool, float and str are not integers)."""
    try:
        if isinstance(x, bool):
            raise TypeError
        return operator.index(x)
    except TypeError:
        raise ValueError(f"{fn}: '{name}' is {x!r}, expected {expected}") from None


def _per_head(x: Any, fn: str, name: str, dtype: np.dtype) -> Optional[np.ndarray]:
    """Per-head values as a contiguous 1-D array of the call's dtype (the library checks their number)."""
    if x is None:
        return None
    a = to_numpy(widen_half(x), fn, name)
    # The extension takes a 1-D float array; a bool array (a mask passed by
    # mistake) or a 2-D array would have to be reinterpreted, not converted.
    if a.dtype.kind not in "fiu" or a.ndim != 1:
        raise ValueError(f"{fn}: '{name}' has dtype {a.dtype} and shape {a.shape}, expected a 1-D float array "
                         "(one value per query head)")
    return np.ascontiguousarray(a, dtype=dtype)


def variant_kwargs(fn: str, dtype: np.dtype, window_size: Any, alibi_slopes: Any, softcap: Any, sinks: Any,
                   position_offset: Any, chunk_size: Any = 0) -> Dict[str, Any]:
    """The extension's keywords for these variants. window_size None = (-1, -1),
    softcap None or 0 = off, chunk_size None or 0 = off."""
    left = right = -1
    if window_size is not None:
        pair = "a pair of integers (left, right), -1 meaning unbounded on that side"
        if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
            raise ValueError(f"{fn}: 'window_size' is {window_size!r}, expected {pair}")
        left, right = (_integer(w, fn, "window_size", pair) for w in window_size)
    cap = 0.0
    if softcap is not None:
        try:
            cap = float(softcap)
        except (TypeError, ValueError):
            raise ValueError(f"{fn}: 'softcap' is {softcap!r}, expected a number (0 or None = off)") from None
    kw = dict(
        window_left=left, window_right=right, softcap=cap,
        chunk_size=0 if chunk_size is None else _integer(chunk_size, fn, "chunk_size", "an integer (0 = off)"),
        position_offset=None if position_offset is None else _integer(position_offset, fn, "position_offset",
                                                                       "an integer (or None)"),
        alibi_slopes=_per_head(alibi_slopes, fn, "alibi_slopes", dtype),
        sinks=_per_head(sinks, fn, "sinks", dtype),
    )
    return kw
