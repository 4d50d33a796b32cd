"""attn.dist (mpi4py) under mpirun, P = 2 and 3, against the single-process
call (tests/python/dist_worker.py does the comparing); skipped, with the
reason, when mpi4py, MPI or the attn._attn_dist extension is absent. The
module itself must import without any of them."""

import os
import shutil
import subprocess
import sys
import time

import pytest

import attn.dist

HERE = os.path.dirname(os.path.abspath(__file__))


def _skip_reason():
    ok, why = attn.dist.available()
    if not ok:
        return f"attn.dist unavailable: {why}"
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (install openmpi-bin: scripts/install-deps.sh)"
    return None


@pytest.mark.parametrize("P", [2, 3])
def test_matches_the_single_process_call(P):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "-np", str(P), sys.executable, os.path.join(HERE, "dist_worker.py")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"attn.dist python: all passed on {P} rank(s)" in res.stdout


def _mpirun(P, *args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "-np", str(P), sys.executable, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("P", [2, 3])
def test_ranks_that_disagree_fail_together(P):
    # Different strategies, forward against backward, a dtype, a layout or a
    # timeout on one rank: ValueError on every rank within seconds (the
    # subprocess timeout turns a hang into a failure).
    why = _skip_reason()
    if why:
        pytest.skip(why)
    res = _mpirun(P, os.path.join(HERE, "dist_disagree_worker.py"), "agree", timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in range(P):
        assert f"agreed on rank {r}" in res.stdout, res.stdout + res.stderr


def test_a_stuck_rank_ends_the_job_with_a_message():
    why = _skip_reason()
    if why:
        pytest.skip(why)
    t0 = time.monotonic()
    res = _mpirun(2, os.path.join(HERE, "dist_disagree_worker.py"), "stuck", timeout=60)
    assert time.monotonic() - t0 < 45
    assert res.returncode == 8, res.stdout + res.stderr
    assert ("error: attn.dist.ring_attention: rank 0 waited 1 s for the other ranks to check their arguments; another "
            "rank died or stopped calling. Aborting the job (exit 8)") in res.stderr, res.stdout + res.stderr
    assert "returned without" not in res.stdout


def test_imports_and_says_why_without_mpi4py():
    # mpi4py blocked in a fresh interpreter: the module imports, available()
    # names the missing piece, the functions raise ImportError saying so.
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"
        "import numpy as np, attn, attn.dist as d\n"
        "ok, why = d.available(); assert not ok and ('mpi4py' in why or 'MPI' in why), why\n"
        "x = np.zeros((1, 1, 2, 4), np.float32)\n"
        "try:\n"
        "    d.ring_attention(x, x, x, None)\n"
        "    raise SystemExit('no ImportError')\n"
        "except ImportError as e:\n"
        "    assert 'attn.dist.ring_attention' in str(e), e\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr
