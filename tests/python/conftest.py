"""Shared pytest plumbing: a recorder for the PyTorch parity figures, printed
as a table at the end of the run (max absolute and relative error per case,
over all random configurations of that case)."""

import os

import pytest

# torch and attn each load an OpenMP runtime: threads spinning after one's
# parallel region would take the cores from the other's next one (README.md,
# "Threads"). Set before the test modules import either.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

_PARITY = {}


class Parity:
    def record(self, case, got, want):
        import numpy as np

        got = np.asarray(got, np.float64)
        want = np.asarray(want, np.float64)
        abs_err = float(np.abs(got - want).max()) if got.size else 0.0
        scale = float(np.abs(want).max()) if want.size else 0.0
        # A result that is zero up to rounding (e.g. the gradient of a mask
        # broadcast along S, a sum of dS over the row) has no relative error.
        rel_err = abs_err / scale if scale > 1e-4 else 0.0
        a, r, n = _PARITY.get(case, (0.0, 0.0, 0))
        _PARITY[case] = (max(a, abs_err), max(r, rel_err), n + 1)
        return abs_err, rel_err


@pytest.fixture
def parity():
    return Parity()


def pytest_terminal_summary(terminalreporter):
    if not _PARITY:
        return
    w = max(len(c) for c in _PARITY)
    terminalreporter.section("attn vs PyTorch: max abs / rel error per case")
    terminalreporter.write_line(f"{'case':<{w}}  {'max abs err':>11}  {'max rel err':>11}  configs")
    for case in sorted(_PARITY):
        a, r, n = _PARITY[case]
        terminalreporter.write_line(f"{case:<{w}}  {a:11.3e}  {r:11.3e}  {n:7d}")
    terminalreporter.write_line("(rel = max |attn - torch| / max |torch| over the output or gradient)")
