"""Run under mpirun by test_dist.py with a scenario: ranks that disagree (the
strategy, forward against backward, a dtype, the layout) must raise
ValueError on every rank naming the difference, then still work together;
"stuck": rank 1 stops calling and rank 0's bounded wait (1 s) aborts the job
with a message. Prints "agreed on rank R" for each rank that saw what it
should."""

import sys
import time

import numpy as np
from mpi4py import MPI

import attn.dist as dist

comm = MPI.COMM_WORLD
P, r = comm.Get_size(), comm.Get_rank()
rng = np.random.default_rng(3)
q, k, v = (rng.standard_normal((1, 6, 11, 8), dtype=np.float32) for _ in range(3))  # H = Hkv = 6: ulysses on 2, 3
sh = lambda x: dist.shard(x, P, r)  # noqa: E731
qs, ks, vs = sh(q), sh(k), sh(v)


def expect(call, *parts):
    try:
        call()
    except ValueError as e:
        missing = [p for p in parts if p not in str(e)]
        if missing:
            print(f"[rank {r}] message lacks {missing}: {e}", flush=True)
            return False
        return True
    print(f"[rank {r}] no ValueError (expected {parts})", flush=True)
    return False


scenario = sys.argv[1]
if scenario == "stuck":
    if r == 0:
        dist.ring_attention(qs, ks, vs, comm, timeout=1.0)
        print("[rank 0] returned without the other ranks", flush=True)
    else:
        time.sleep(60)
    sys.exit(3)

ok = True
first = dist.ring_attention if r == 0 else dist.ulysses_attention
ok &= expect(lambda: first(qs, ks, vs, comm), "ranks disagree on the call",
             "attn::dist::ulysses_attention, rank 0 attn::dist::ring_attention")
dy = sh(rng.standard_normal((1, 6, 11, 8), dtype=np.float32))
ok &= expect(lambda: dist.ring_attention(qs, ks, vs, comm) if r == 0 else
             dist.ring_attention_backward(dy, qs, ks, vs, comm), "ranks disagree on the call")
bad_q = qs.astype(np.float64) if r == P - 1 else qs
ok &= expect(lambda: dist.ring_attention(bad_q, ks, vs, comm),
             "'query' has dtype float64" if r == P - 1 else f"rank {P - 1} rejected its arguments")
ok &= expect(lambda: dist.ring_attention(qs, ks, vs, comm, layout="zigzag" if r == 0 else "diagonal"),
             "layout 'diagonal'" if r != 0 else "rank 1 rejected its arguments")
ok &= expect(lambda: dist.ring_attention(qs, ks, vs, comm, timeout=-1 if r == 0 else None),
             "'timeout' is -1" if r == 0 else "rank 0 rejected its arguments")
# Agreed again: the result is the single-process one.
out = dist.ring_attention(qs, ks, vs, comm)
out2 = dist.ulysses_attention(qs, ks, vs, comm)
ok &= bool(np.abs(out - out2).max() < 1e-5)
ok = comm.allreduce(ok, op=MPI.LAND)
if ok:
    print(f"agreed on rank {r}", flush=True)
sys.exit(0 if ok else 1)
