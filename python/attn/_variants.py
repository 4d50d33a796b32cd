"""The attention variants' keyword arguments (docs/variants.md), checked once
for the dense and the packed (varlen) calls and turned into the extension's
keywords: window=(left, right), alibi_slopes (H), softcap, sinks (H),
position_offset."""

from __future__ import annotations

import numbers
from typing import Any, Dict, Optional

import numpy as np

from ._arrays import to_numpy, widen_half


def _per_head(x: Any, fn: str, name: str, H: int, dtype: np.dtype) -> Optional[np.ndarray]:
    """One value per query head as a contiguous 1-D array of the call's dtype."""
    if x is None:
        return None
    a = to_numpy(widen_half(x), fn, name)
    if a.dtype.kind not in "fiu":
        raise ValueError(f"{fn}: '{name}' has dtype {a.dtype}, expected a float array of {H} values "
                         "(one per query head)")
    if a.shape != (H,):
        raise ValueError(f"{fn}: '{name}' has shape {a.shape}, expected ({H},) (one value per query head)")
    return np.ascontiguousarray(a, dtype=dtype)


def _int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def variant_kwargs(fn: str, H: int, dtype: np.dtype, window: Any, alibi_slopes: Any, softcap: Any,
                   sinks: Any, position_offset: Any) -> Dict[str, Any]:
    """The extension's keywords for these variants; ValueError naming the argument when one is bad."""
    left = right = -1
    if window is not None:
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(_int(w) for w in window)):
            raise ValueError(f"{fn}: 'window' is {window!r}, expected a pair of integers (left, right), "
                             "-1 meaning unbounded on that side")
        left, right = int(window[0]), int(window[1])
        if left < -1 or right < -1:
            raise ValueError(f"{fn}: 'window' is {tuple(window)!r}; each side must be >= 0 or -1 (unbounded)")
    cap = 0.0
    if softcap is not None:
        if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool):
            raise ValueError(f"{fn}: 'softcap' is {softcap!r}, expected a positive finite number (or None)")
        cap = float(softcap)
        if not (np.isfinite(cap) and cap > 0):
            raise ValueError(f"{fn}: 'softcap' is {softcap!r}, expected a positive finite number (or None)")
    if position_offset is not None and not _int(position_offset):
        raise ValueError(f"{fn}: 'position_offset' is {position_offset!r}, expected an integer (or None)")
    return dict(
        window_left=left, window_right=right, softcap=cap,
        position_offset=None if position_offset is None else int(position_offset),
        alibi_slopes=_per_head(alibi_slopes, fn, "alibi_slopes", H, dtype),
        sinks=_per_head(sinks, fn, "sinks", H, dtype),
    )
