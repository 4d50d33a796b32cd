"""The ring's block skipping, measured: causal ring attention forward with and
without a sliding window, through attn.dist (mpi4py), median of REPS runs.
Run under mpirun with the package's interpreter (an absolute path: mpirun
would otherwise start the system Python without the venv):

  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 \\
    mpirun --oversubscribe --bind-to none -np 2 $PWD/build-py/venv/bin/python bench/ring_window.py [N] [WINDOW]
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import attn.dist as dist

comm = MPI.COMM_WORLD
N = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
W = int(sys.argv[2]) if len(sys.argv) > 2 else 256
H, E, REPS = 8, 64, 3
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, H, N, E), dtype=np.float32) for _ in range(3))
qr, kr, vr = (dist.shard(x, comm.size, comm.rank) for x in (q, k, v))
for window in (None, (W, -1)):
    times = []
    for _ in range(REPS):
        comm.Barrier()
        t = time.perf_counter()
        dist.ring_attention(qr, kr, vr, comm, is_causal=True, window_size=window, num_threads=1)
        comm.Barrier()
        times.append(time.perf_counter() - t)
    if comm.rank == 0:
        print(f"P = {comm.size}, N = {N}, H = {H}, E = {E}, causal, window = {window}: "
              f"ring forward {sorted(times)[REPS // 2]:.3f} s (median of {REPS})", flush=True)
