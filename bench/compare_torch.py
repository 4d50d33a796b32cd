#!/usr/bin/env python3
"""attn's fused backend against PyTorch's CPU scaled_dot_product_attention.

Same shapes as attn-bench (B=1, H=8, E=Ev=64, float32), same run: for each
shape, PyTorch is timed, then attn (through `attn-bench --json -`, which
validates the fused backend against the reference first), then PyTorch
again, so a change in machine load hits both. Prints the medians and the
ratio attn/torch (below 1 means attn is faster).

    python3 bench/compare_torch.py [--attn-bench build/bench/attn-bench]
                                   [--lengths 512,1024] [--threads 1,2] [--json out.json]

bfloat16 (--dtype bfloat16): PyTorch's SDPA on float32 and on bfloat16
tensors against attn's fused backend twice, exact float32 ("fused") and
with bfloat16 products (compute_dtype bfloat16, "fused-bf16"), and, forward
only, on each instruction path named by --bf16-paths, all through one
attn-bench run that also measures the FMA and AMX peaks; --dim sets
E = Ev (64 by default), --modes fwd,fwdbwd.

    python3 bench/compare_torch.py --dtype bfloat16 --lengths 4096 --threads 2 --dim 128 --modes fwd \
        --bf16-paths amx,avx512,portable

Layer mode (--layer): attn.MultiheadAttention against
torch.nn.MultiheadAttention through both Python front ends (batch_first,
float32, self-attention, the same weights: attn loads torch's state_dict),
forward (both under torch.no_grad(), so neither layer keeps state for a
backward) and forward+backward (torch autograd; attn's layer backward). The
two are timed alternately, one call each per round, so
load changes hit both; the outputs and input gradients are compared first.
--layer-dtype bfloat16: torch's layer and inputs in bfloat16 against attn's
float32 layer with compute_dtype="bfloat16" (bfloat16 operands, float32 sums).
--layer-dtype bfloat16-params: the same against attn's layer with bfloat16
parameters (dtype=torch.bfloat16), both on the same bfloat16 torch tensors.

    python3 bench/compare_torch.py --layer [--layer-shapes "8,128,256,4;4,512,512,8"] [--threads 2]
                                   [--reps 15] [--json out.json]

Each layer row also times the attention inside alone, as each layer calls it, in the same
alternating rounds: torch's SDPA on the strided (B, H, N, d) views of a packed (B, N, 3D)
projection, attn's on dense (B, H, N, d) heads (attn's layer splits its projections into dense
heads, and in the backward dY and Y too). The layer minus its attention is its projections
(GEMMs, bias, head split, copies).

GEMM mode (--gemm): the GEMMs of the same layer shapes alone (forward: x·W_inᵀ, o·W_oᵀ; backward:
dyᵀ·o, dy·W_o, dpᵀ·x, dp·W_in), torch.matmul (MKL) against attn's detail::gemm (oneDNN, tiles on
OpenMP threads) through `attn-gemm-bench --json -`, which validates each product first; per shape and
summed per mode.

    python3 bench/compare_torch.py --gemm [--attn-gemm-bench build/bench/attn-gemm-bench]
                                   [--layer-shapes ...] [--threads 2] [--reps 7]

Decode mode (--decode): the shapes of attn-decode-bench (B, H, Hkv, L, S, E),
a KV cache of S tokens and L new queries (bottom-right causal). PyTorch SDPA
is timed twice per shape: with enable_gqa (grouped heads, K/V not copied)
and with the query heads of a group packed into the query axis (the trick
inference stacks use: q (B, Hkv, G·L, E) against K/V (B, Hkv, S, E)); attn
through `attn-decode-bench --json -` (float32, float16 and bfloat16 cache);
with --ggml-driver, ggml's flash_attn_ext too (a driver built outside this
repository that prints one JSON line, see docs/decode.md).

    python3 bench/compare_torch.py --decode [--attn-decode-bench build/bench/attn-decode-bench]
                                   [--shapes "1,32,8,1,4096,128;..."] [--threads 2]
                                   [--ggml-driver /path/to/fa_bench] [--json out.json]
                                   [--decode-window W]

With --decode-window W every query sees itself and the W keys before it (a
causal sliding window, Mistral's and gpt-oss's): attn runs over the whole
cache of S tokens with the window (`attn-decode-bench --window W`), reading
only the last L + W keys; PyTorch and ggml get those L + W keys already cut
out of the cache (what a rolling window cache holds), their best case.

Variants mode (--variants): each variant of docs/variants.md (attn through
`attn-bench-variants --sections case`, which validates fused against
reference first) against PyTorch's CPU SDPA on the equivalent dense form,
B=1, H=8, E=Ev=64, L=S=--variant-len, forward (torch under no_grad) and
forward+backward (torch autograd, gradients of q, k, v and of the sinks):
  plain, causal       no mask / is_causal=True
  window              causal with --variant-window keys: a boolean band mask
  alibi               the additive bias -slope_h*|i - j| (H, L, S), not causal
  softcap             no SDPA form: the formula in torch (matmul, c*tanh(s/c),
                      softmax, matmul), as eager Gemma 2 implementations do
  sinks               a key column of zeros appended to K and V, with the sink
                      logit as its bias (B, H, 1, S + 1)
  varlen              --varlen-count sequences of lengths uniform in
                      [32, --varlen-max] (seeded), packed; torch: a loop of SDPA
                      calls, one per sequence
Torch is timed before and after attn (the median of both), so a change in
load hits both; the ratio attn/torch is printed (below 1: attn faster).

    python3 bench/compare_torch.py --variants [--attn-bench-variants build/bench/attn-bench-variants]
                                   [--variant-len 2048] [--threads 2] [--json out.json]
"""
import argparse
import random
import json
import os
import statistics
import subprocess
import sys
import time


def parse_list(text, kind=int):
    return [kind(x) for x in text.split(",") if x]


def time_torch(torch, L, causal, mode, threads, reps, heads=8, dim=64, dtype="float32"):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, L, dim, generator=g).to(getattr(torch, dtype)) for _ in range(4))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    times = []
    for _ in range(reps + 1):  # the first run is a warm-up
        if mode == "fwd":
            t0 = time.perf_counter()
            with torch.no_grad():
                sdpa(q, k, v, is_causal=causal)
            dt = time.perf_counter() - t0
        else:
            qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
            t0 = time.perf_counter()
            out = sdpa(qq, kk, vv, is_causal=causal)
            out.backward(dout)
            dt = time.perf_counter() - t0
        times.append(dt)
    return statistics.median(times[1:])


def time_attn(binary, L, causal, mode, threads, backends="fused", dim=64, doc_out=None):
    """(median seconds, validation) of the first backend; with several, a dict by backend name.
    doc_out (a dict), if given, gets attn-bench's whole JSON document (the machine's peaks)."""
    cmd = [binary, "--json", "-", "--lengths", str(L), "--causal", str(int(causal)), "--modes", mode,
           "--threads", str(threads), "--backends", backends, "--full-check-len", "0", "--dim", str(dim)]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    doc = json.loads(res.stdout)
    if doc_out is not None:
        doc_out.update(doc)
    rows = {r["backend"]: (r["median_s"], r["validation"]) for r in doc["results"]}
    return rows if "," in backends else rows[backends]


def bf16_main(args, torch):
    """--dtype bfloat16: PyTorch's SDPA in float32 and bfloat16 against attn's float32 forward, its
    bfloat16 products on the library's path and (forward) on every other path this CPU runs, with
    the FMA and AMX peaks attn-bench measured in the same run."""
    dim = args.dim
    paths = [p for p in args.bf16_paths.split(",") if p]
    print(f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}), "
          f"attn-bench {args.attn_bench}, B=1 H=8 E=Ev={dim}; ms, GFLOP/s in brackets; ratios are attn's time over "
          f"the other's")
    rows = []
    for mode in parse_list(args.modes, str):
        for L in parse_list(args.lengths):
            for causal in parse_list(args.causal):
                for threads in parse_list(args.threads):
                    extra = [f"fused-bf16-{p}" for p in paths] if mode == "fwd" else []
                    doc = {}
                    tb1 = time_torch(torch, L, bool(causal), mode, threads, args.reps, dim=dim, dtype="bfloat16")
                    tf1 = time_torch(torch, L, bool(causal), mode, threads, args.reps, dim=dim)
                    a = time_attn(args.attn_bench, L, bool(causal), mode, threads,
                                  ",".join(["fused", "fused-bf16"] + extra), dim, doc)
                    tf2 = time_torch(torch, L, bool(causal), mode, threads, args.reps, dim=dim)
                    tb2 = time_torch(torch, L, bool(causal), mode, threads, args.reps, dim=dim, dtype="bfloat16")
                    tb, tf = statistics.median([tb1, tb2]), statistics.median([tf1, tf2])
                    flop = 4.0 * 8 * L * L * dim / (2 if causal else 1) * (3.5 if mode == "fwdbwd" else 1)
                    fma = doc.get("fma_peak_gflops", {}).get(str(threads), 0)
                    amx = doc.get("amx_peak_gflops", {}).get(str(threads), 0)
                    row = dict(L=L, E=dim, causal=bool(causal), mode=mode, threads=threads, torch_bf16_s=tb,
                               torch_f32_s=tf, fma_peak_gflops=fma, amx_peak_gflops=amx,
                               bf16_path=doc.get("bf16_path", ""), attn={k: v[0] for k, v in a.items()},
                               validation={k: v[1] for k, v in a.items()})
                    rows.append(row)
                    print(f"\n{mode} L=S={L} {'causal' if causal else 'full'} threads={threads}: FMA peak {fma:.0f}, "
                          f"AMX peak {amx:.0f} GFLOP/s; attn's bfloat16 path: {row['bf16_path']}")
                    for name, t in [("torch bf16", tb), ("torch f32", tf)] + [(k, v[0]) for k, v in a.items()]:
                        ratio = "" if name.startswith("torch") else f"  /torch bf16 {t / tb:.3f}  /torch f32 {t / tf:.3f}  /attn f32 {t / a['fused'][0]:.3f}  {a[name][1]}"
                        print(f"  {name:20} {t * 1e3:9.2f} ms ({flop / t * 1e-9:7.1f}){ratio}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(dict(torch=torch.__version__, results=rows), out, indent=2)
    return 0


DECODE_SHAPES = ("1,32,8,1,4096,128;1,32,8,1,32768,128;1,8,8,1,16384,64;4,32,8,1,8192,128;"
                 "1,32,8,1,131072,128;1,32,8,512,8192,128")


def median_time(fn, reps, before=None):
    """Median seconds of fn over reps runs after a warm-up; before() runs untimed ahead of each."""
    times = []
    for _ in range(reps + 1):  # the first run is a warm-up
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def time_torch_decode(torch, shape, threads, reps, window=-1):
    """(grouped, packed) medians in seconds for one decode shape, float32; with
    window >= 0 query i sees keys S - L + i - window .. S - L + i."""
    B, H, Hkv, L, S, E = shape
    G = H // Hkv
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, E, generator=g)
    k = torch.randn(B, Hkv, S, E, generator=g)
    v = torch.randn(B, Hkv, S, E, generator=g)
    # Bottom-right causal: query i sees keys j <= S - L + i (no mask needed for L = 1).
    mask = None
    if L > 1:
        pos = (S - L + torch.arange(L))[:, None]
        mask = torch.arange(S)[None, :] <= pos
        if window >= 0:
            mask &= torch.arange(S)[None, :] >= pos - window
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # Each call reads K/V from memory, as attn-decode-bench's do: a pass over
    # 256 MiB (well above the L3) evicts the caches before it, untimed.
    flush_buf = torch.ones(64 << 20)
    flush = lambda: flush_buf.sum()  # noqa: E731
    with torch.no_grad():
        grouped = median_time(lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True), reps, flush)
        # Packed: row m = g·L + i of (B, Hkv, G·L, E) is query i of head hk·G + g.
        qp = q.view(B, Hkv, G * L, E)
        mp = None if mask is None else mask.repeat(G, 1)
        packed = median_time(lambda: sdpa(qp, k, v, attn_mask=mp), reps, flush)
    return grouped, packed


def decode_main(args, torch):
    shapes = [tuple(int(x) for x in item.split(",")) for item in args.shapes.split(";") if item]
    threads = parse_list(args.threads)[-1]
    print(f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}), "
          f"{threads} threads, attn-decode-bench {args.attn_decode_bench}")
    head = f"{'B,H,Hkv,L,S,E':22} {'torch gqa':>9} {'torch pk':>9} {'attn f32':>9} {'attn f16':>9} {'attn bf16':>9}"
    if args.ggml_driver:
        head += f" {'ggml f32':>9} {'ggml f16':>9}"
    print(head + "   (ms; GB/s of f32 K/V for attn, of the probe, of a plain read of the same bytes)")
    W = args.decode_window
    if W >= 0:
        print(f"sliding window of {W} keys: attn over the whole cache, torch and ggml over the last L + {W} keys")
    rows = []
    for shape in shapes:
        text = ",".join(str(x) for x in shape)
        B, H, Hkv, L, S, E = shape
        peer = shape if W < 0 else (B, H, Hkv, L, min(S, L + W), E)  # the peers' cache: the keys the window holds
        g1, p1 = time_torch_decode(torch, peer, threads, args.reps, W)
        res = subprocess.run([args.attn_decode_bench, "--json", "-", "--shapes", text, "--threads", str(threads),
                              "--no-dense", "--bandwidth-mib", "256", "--window", str(W)],
                             check=True, capture_output=True, text=True)
        doc = json.loads(res.stdout)
        attn = {r["dtype"]: r for r in doc["rows"] if r["variant"] == "decode"}
        reads = {r["dtype"]: r for r in doc["rows"] if r["variant"] == "read"}  # a plain read of the same bytes
        g2, p2 = time_torch_decode(torch, peer, threads, args.reps, W)
        row = dict(shape=shape, window=W, threads=threads, torch_gqa_ms=1e3 * statistics.median([g1, g2]),
                   torch_packed_ms=1e3 * statistics.median([p1, p2]),
                   read_bandwidth_gbs=attn["float32"]["read_bandwidth_gbs"] if "float32" in attn else None,
                   attn={k: dict(ms=r["ms"], kv_gbs=r["kv_gbs"], check=r["check"]) for k, r in attn.items()},
                   read={k: dict(ms=r["ms"], kv_gbs=r["kv_gbs"]) for k, r in reads.items()})
        line = (f"{text:22} {row['torch_gqa_ms']:9.2f} {row['torch_packed_ms']:9.2f} "
                + " ".join(f"{attn[d]['ms']:9.2f}" if d in attn else f"{'-':>9}" for d in ("float32", "float16", "bfloat16")))
        if args.ggml_driver:
            row["ggml"] = {}
            for kv in ("f32", "f16"):
                out = subprocess.run([args.ggml_driver, *[str(x) for x in peer], kv, str(threads), str(max(args.reps, 5))],
                                     check=True, capture_output=True, text=True).stdout
                row["ggml"][kv] = json.loads(out.strip().splitlines()[-1])["ms"]
            line += f" {row['ggml']['f32']:9.2f} {row['ggml']['f16']:9.2f}"
        if "float32" in attn:
            line += f"   {attn['float32']['kv_gbs']:.1f} GB/s of {attn['float32']['read_bandwidth_gbs']:.1f}"
            if "float32" in reads:
                line += f", a plain read {reads['float32']['kv_gbs']:.1f}"
        print(line, flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, mode="decode", results=rows), f, indent=2)
    return 0


VARIANTS = ("plain", "causal", "window", "alibi", "softcap", "sinks", "varlen")


def alibi_slopes(H):
    # attn-bench-variants' slopes: 2^(-8 (h + 1) / H)
    return [2.0 ** (-8.0 * (h + 1) / H) for h in range(H)]


def torch_variant(torch, variant, mode, args, threads, lengths):
    """Median seconds of PyTorch on the dense equivalent of one variant."""
    torch.set_num_threads(threads)
    H, E, n = 8, 64, args.variant_len
    g = torch.Generator().manual_seed(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    bwd = mode == "fwdbwd"
    if variant == "varlen":
        total = sum(lengths)
        q, k, v, dout = (torch.randn(total, H, E, generator=g) for _ in range(4))
        starts = [sum(lengths[:b]) for b in range(len(lengths))]

        def run():
            qq, kk, vv = (x.detach().requires_grad_(bwd) for x in (q, k, v))
            outs = []
            for s0, L in zip(starts, lengths):
                view = lambda x: x[s0:s0 + L].transpose(0, 1).unsqueeze(0).contiguous()  # (1, H, L, E)
                outs.append(sdpa(view(qq), view(kk), view(vv)))
            if bwd:
                torch.cat([o[0].transpose(0, 1) for o in outs]).backward(dout)
        return timed(torch, run, bwd, args.reps)

    q, k, v, dout = (torch.randn(1, H, n, E, generator=g) for _ in range(4))
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    mask, causal, extra = None, False, []
    if variant == "causal":
        causal = True
    elif variant == "window":
        mask = (j <= i) & (j > i - args.variant_window)
    elif variant == "alibi":
        slopes = torch.tensor(alibi_slopes(H))[:, None, None]
        mask = (-slopes * (i - j).abs().float()).unsqueeze(0)  # (1, H, L, S)
    elif variant == "sinks":
        extra = [torch.full((H,), 0.5)]
    zeros = torch.zeros(1, H, 1, E)

    def run():
        qq, kk, vv = (x.detach().requires_grad_(bwd) for x in (q, k, v))
        if variant == "softcap":
            c = args.softcap
            s = (qq @ kk.transpose(-1, -2)) * (E ** -0.5)
            out = torch.softmax(c * torch.tanh(s / c), dim=-1) @ vv
        elif variant == "sinks":
            sinks = extra[0].detach().requires_grad_(bwd)
            bias = torch.cat([torch.zeros(1, H, 1, n), sinks.view(1, H, 1, 1)], dim=-1)  # (1, H, 1, S + 1)
            out = sdpa(qq, torch.cat([kk, zeros], dim=2), torch.cat([vv, zeros], dim=2), attn_mask=bias)
        else:
            out = sdpa(qq, kk, vv, attn_mask=mask, is_causal=causal)
        if bwd:
            out.backward(dout)

    return timed(torch, run, bwd, args.reps)


def timed(torch, run, bwd, reps):
    """Median seconds of run(), under no_grad for a forward."""
    if bwd:
        return median_time(run, reps)
    with torch.no_grad():
        return median_time(run, reps)


def attn_variant(args, variant, mode, threads, lengths):
    cmd = [args.attn_bench_variants, "--sections", "case", "--case", variant, "--case-len", str(args.variant_len),
           "--case-window", str(args.variant_window), "--softcap", str(args.softcap), "--modes", mode,
           "--threads", str(threads), "--reps", str(args.reps)]
    if variant == "varlen":
        cmd += ["--varlen-lengths", ",".join(str(x) for x in lengths)]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def variants_main(args, torch):
    if not os.path.exists(args.attn_bench_variants):
        print(f"compare_torch: {args.attn_bench_variants} not found; build it first "
              "(`cmake --build build --target attn-bench-variants`).")
        return 1
    rng = random.Random(args.seed)
    lengths = [rng.randint(32, args.varlen_max) for _ in range(args.varlen_count)]
    threads = parse_list(args.threads)[-1]
    load = os.getloadavg()
    first = attn_variant(args, "plain", "fwd", threads, lengths)
    print(f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}), attn fused target "
          f"{first['target']}, {threads} threads, {os.cpu_count()} CPUs; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}")
    print(f"B=1 H=8 E=Ev=64 L=S={args.variant_len}; window {args.variant_window} keys (causal); softcap "
          f"{args.softcap}; varlen {args.varlen_count} sequences, lengths {','.join(map(str, lengths))}")
    print(f"{'variant':8} {'mode':7} {'torch ms':>10} {'attn ms':>10} {'attn/torch':>10}  validation")
    rows = []
    for mode in args.modes.split(","):
        for variant in args.variant_list.split(","):
            t1 = torch_variant(torch, variant, mode, args, threads, lengths)
            a = attn_variant(args, variant, mode, threads, lengths)
            t2 = torch_variant(torch, variant, mode, args, threads, lengths)
            t = statistics.median([t1, t2])
            rows.append(dict(variant=variant, mode=mode, threads=threads, torch_s=t, attn_s=a["median_s"],
                             ratio=a["median_s"] / t, validation=a["validation"]))
            print(f"{variant:8} {mode:7} {t * 1e3:10.2f} {a['median_s'] * 1e3:10.2f} {a['median_s'] / t:10.3f}  "
                  f"{a['validation']}", flush=True)
    worst = max(rows, key=lambda r: r["ratio"])
    faster = sum(r["ratio"] < 1 for r in rows)
    print(f"\nattn faster than torch in {faster} of {len(rows)}; slowest relative to torch: {worst['variant']} "
          f"{worst['mode']}: attn/torch = {worst['ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, mode="variants", load=load, lengths=lengths, results=rows), f,
                      indent=2)
    return 0


def layer_rows(torch, attn, shapes, threads, reps, dtype="float32"):
    """Alternating timings of attn.MultiheadAttention and torch.nn.MultiheadAttention, and of the
    attention inside each alone (on the strided (B, H, N, d) views of a packed (B, N, 3D) projection,
    as each layer calls it: torch on the strided views, attn on dense heads), so that layer - attention
    = the projections (GEMMs, bias, head split, copies). dtype bfloat16: torch's layer, inputs and
    attention in bfloat16 against attn's float32 layer with compute_dtype="bfloat16" (every product on
    bfloat16 operands, float32 sums)."""
    import numpy as np
    import torch.nn.functional as F

    params = dtype == "bfloat16-params"
    bf16 = dtype == "bfloat16" or params
    tdt = torch.bfloat16 if bf16 else torch.float32
    compute = dict(compute_dtype="bfloat16") if bf16 else {}
    rows = []
    for B, N, D, H in shapes:
        torch.set_num_threads(threads)
        ref = torch.nn.MultiheadAttention(D, H, batch_first=True)
        ref = ref.to(tdt)
        mine = attn.MultiheadAttention(D, H, batch_first=True, dtype=torch.bfloat16 if params else np.float32,
                                       seed=0, **compute)
        mine.load_state_dict({n: p.detach() for n, p in ref.state_dict().items()})
        rng = np.random.default_rng(0)
        x = rng.standard_normal((B, N, D)).astype(np.float32)
        dout = rng.standard_normal((B, N, D)).astype(np.float32)
        xt, doutt = torch.from_numpy(x).to(tdt), torch.from_numpy(dout).to(tdt)
        if params:  # attn's layer on the same bfloat16 tensors
            x, dout = xt, doutt
        as_np = (lambda a: a.float().numpy()) if params else (lambda a: a)

        # Validate: the same output and input gradient.
        ya, _ = mine(x, x, x, need_weights=False)
        ga = mine.backward(dout)["query"]
        xg = xt.clone().requires_grad_(True)
        yt, _ = ref(xg, xg, xg, need_weights=False)
        yt.backward(doutt)
        check = (f"max|dy| {np.abs(as_np(ya) - yt.detach().float().numpy()).max():.1e}, "
                 f"max|dx| {np.abs(as_np(ga) - xg.grad.float().numpy()).max():.1e}")

        # The attention alone: q, k, v as (B, H, N, d) views of one (B, N, 3D) array.
        qkv = rng.standard_normal((B, N, 3 * D)).astype(np.float32)
        q, k, v = (qkv[:, :, i * D:(i + 1) * D].reshape(B, N, H, D // H).transpose(0, 2, 1, 3)
                   for i in range(3))
        dy = rng.standard_normal((B, N, H, D // H)).astype(np.float32).transpose(0, 2, 1, 3)
        qd, kd, vd, dyd = (np.ascontiguousarray(t) for t in (q, k, v, dy))  # attn's layer: dense heads
        qkvt = torch.from_numpy(qkv).to(tdt)
        qt, kt, vt = (qkvt[:, :, i * D:(i + 1) * D].view(B, N, H, D // H).transpose(1, 2) for i in range(3))
        dyt = torch.from_numpy(dy).to(tdt)

        def torch_fwd():
            with torch.no_grad():
                ref(xt, xt, xt, need_weights=False)

        def torch_fwdbwd():
            xx = xt.detach().requires_grad_(True)
            y, _ = ref(xx, xx, xx, need_weights=False)
            y.backward(doutt)

        def attn_fwd():  # inference, as torch's: nothing kept for a backward
            with torch.no_grad():
                mine(x, x, x, need_weights=False)

        def attn_fwdbwd():
            mine(x, x, x, need_weights=False)
            mine.backward(dout)

        def torch_sdpa_fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(qt, kt, vt)

        def torch_sdpa_fwdbwd():
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (qt, kt, vt))
            F.scaled_dot_product_attention(qq, kk, vv).backward(dyt)

        def attn_sdpa_fwd():
            attn.scaled_dot_product_attention(qd, kd, vd, **compute)

        def attn_sdpa_fwdbwd():
            o, lse = attn.scaled_dot_product_attention(qd, kd, vd, return_lse=True, **compute)
            attn.scaled_dot_product_attention_backward(dyd, qd, kd, vd, output=o, lse=lse, **compute)

        for mode, fns in (("fwd", (torch_fwd, attn_fwd, torch_sdpa_fwd, attn_sdpa_fwd)),
                          ("fwdbwd", (torch_fwdbwd, attn_fwdbwd, torch_sdpa_fwdbwd, attn_sdpa_fwdbwd))):
            times = [[] for _ in fns]
            for r in range(reps + 1):  # round 0 warms up
                order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
                for i in order:
                    t0 = time.perf_counter()
                    fns[i]()
                    times[i].append(time.perf_counter() - t0)
            t, a, ts, as_ = (statistics.median(x[1:]) for x in times)
            # The paired ratio: the median over the rounds of attn/torch within one round (the two
            # calls of a round run back to back, so a slow spell of the machine cancels in it).
            paired = statistics.median(ar / tr for ar, tr in zip(times[1][1:], times[0][1:]))
            rows.append(dict(B=B, N=N, D=D, H=H, mode=mode, threads=threads, torch_s=t, attn_s=a, ratio=a / t,
                             paired_ratio=paired,
                             torch_attention_s=ts, attn_attention_s=as_, torch_proj_s=t - ts, attn_proj_s=a - as_,
                             validation=check))
            print(f"{B:3d} {N:5d} {D:4d} {H:3d} {mode:7} {threads:2d} {t * 1e3:10.2f} {a * 1e3:10.2f} "
                  f"{a / t:10.3f} | {ts * 1e3:8.2f} {as_ * 1e3:8.2f} {as_ / ts:6.3f} | {(t - ts) * 1e3:8.2f} "
                  f"{(a - as_) * 1e3:8.2f} {(a - as_) / max(t - ts, 1e-9):6.3f} | {paired:6.3f}  {check}", flush=True)
    return rows


def layer_gemms(B, N, D):
    """The GEMMs of a packed self-attention layer, (M, N, K, ta, tb), as src/multihead.cpp calls them:
    forward: [q|k|v] = x·W_inᵀ, y = o·W_oᵀ; backward: dW_o = dyᵀ·o, do = dy·W_o, dW_in = dpᵀ·x,
    dx = dp·W_in (dp = [dq|dk|dv], one product each over the packed weight)."""
    R = B * N
    fwd = [(R, 3 * D, D, 0, 1), (R, D, D, 0, 1)]
    bwd = [(D, D, R, 1, 0), (R, D, D, 0, 0), (3 * D, D, R, 1, 0), (R, D, 3 * D, 0, 0)]
    return fwd, bwd


def time_torch_gemm(torch, shape, reps):
    M, N, K, ta, tb = shape
    A = torch.randn(K, M) if ta else torch.randn(M, K)
    B = torch.randn(N, K) if tb else torch.randn(K, N)
    a, b = (A.t() if ta else A), (B.t() if tb else B)
    C = torch.empty(M, N)
    return median_time(lambda: torch.matmul(a, b, out=C), reps)


def gemm_main(args, torch):
    """The layer's GEMMs alone: torch.matmul (MKL in PyTorch's wheel) against attn's detail::gemm
    (oneDNN) through attn-gemm-bench, shape by shape and summed per layer mode."""
    if not os.path.exists(args.attn_gemm_bench):
        print(f"compare_torch --gemm: {args.attn_gemm_bench} not found; build first (`make build`).")
        return 1
    threads = int(parse_list(args.threads)[0])
    torch.set_num_threads(threads)
    shapes = [tuple(parse_list(s)) for s in args.layer_shapes.split(";") if s]
    load = os.getloadavg()
    print(f"torch {torch.__version__} (MKL {torch.backends.mkl.is_available()}), attn-gemm-bench "
          f"{args.attn_gemm_bench}, {threads} threads; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'layer B,N,D':>14} {'mode':6} {'M':>6} {'N':>6} {'K':>6} {'ta':>2} {'tb':>2} {'torch ms':>9} "
          f"{'attn ms':>9} {'attn/torch':>10}")
    rows = []
    for B, N, D, H in shapes:
        fwd, bwd = layer_gemms(B, N, D)
        for mode, gemms in (("fwd", fwd), ("bwd", bwd)):
            text = ";".join(",".join(str(v) for v in g) for g in gemms)
            res = subprocess.run([args.attn_gemm_bench, "--shapes", text, "--threads", str(threads),
                                  "--reps", str(args.reps), "--peak-seconds", "0", "--json", "-"], capture_output=True, text=True)
            if res.returncode != 0:
                print(res.stderr)
                return 1
            mine = json.loads(res.stdout)["results"]
            tsum = asum = 0.0
            for g, m in zip(gemms, mine):
                t = statistics.median([time_torch_gemm(torch, g, args.reps) for _ in range(2)])
                a = m["median_s"]
                tsum, asum = tsum + t, asum + a
                rows.append(dict(B=B, N=N, D=D, H=H, mode=mode, M=g[0], N_=g[1], K=g[2], ta=g[3], tb=g[4],
                                 torch_s=t, attn_s=a, ratio=a / t))
                print(f"{f'{B},{N},{D}':>14} {mode:6} {g[0]:6d} {g[1]:6d} {g[2]:6d} {g[3]:2d} {g[4]:2d} "
                      f"{t * 1e3:9.2f} {a * 1e3:9.2f} {a / t:10.3f}", flush=True)
            print(f"{f'{B},{N},{D}':>14} {mode:6} {'sum':>27} {tsum * 1e3:9.2f} {asum * 1e3:9.2f} "
                  f"{asum / tsum:10.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, mode="gemm", load=load, results=rows), f, indent=2)
    return 0


def main_layer(args, torch):
    try:
        import attn
    except ImportError as e:
        print(f"compare_torch --layer: the attn Python package is not importable ({e}); `make python-install` "
              "and run with build-py/venv/bin/python.")
        return 1
    shapes = [tuple(parse_list(s)) for s in args.layer_shapes.split(";") if s]
    load = os.getloadavg()
    print(f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}), attn "
          f"{attn.__version__}; {args.layer_dtype}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'':28} {'whole layer':^32} | {'attention alone':^24} | {'projections = layer - attention':^24} "
          f"| layer")
    print(f"{'B':>3} {'N':>5} {'D':>4} {'H':>3} {'mode':7} {'th':>2} {'torch ms':>10} {'attn ms':>10} "
          f"{'attn/torch':>10} | {'torch':>8} {'attn':>8} {'ratio':>6} | {'torch':>8} {'attn':>8} {'ratio':>6} "
          f"| {'paired':>6}  validation")
    print("(attn/torch: ratio of the medians; paired: median over the rounds of the ratio within a round)")
    rows = []
    for threads in parse_list(args.threads):
        rows += layer_rows(torch, attn, shapes, threads, args.reps, args.layer_dtype)
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"\nslowest relative to torch: (B, N, D, H) = ({worst['B']}, {worst['N']}, {worst['D']}, {worst['H']}) "
          f"{worst['mode']} threads={worst['threads']}: attn/torch = {worst['ratio']:.3f}")
    worst_p = max(rows, key=lambda r: r["paired_ratio"])
    print(f"slowest, paired: (B, N, D, H) = ({worst_p['B']}, {worst_p['N']}, {worst_p['D']}, {worst_p['H']}) "
          f"{worst_p['mode']} threads={worst_p['threads']}: {worst_p['paired_ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, mode="layer", load=load, results=rows), f, indent=2)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attn-bench", default=os.path.join("build", "bench", "attn-bench"))
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--reps", type=int, default=3, help="torch repetitions per shape (attn-bench picks its own)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16: torch bfloat16 against attn float32 and bfloat16 products (see above)")
    ap.add_argument("--dim", type=int, default=64, help="--dtype bfloat16: E = Ev")
    ap.add_argument("--bf16-paths", default="", help="--dtype bfloat16, forward: also time these instruction "
                    "paths of attn's bfloat16 products (amx, avx512, portable; comma-separated)")
    ap.add_argument("--json", default="", help="write the results here too")
    ap.add_argument("--decode", action="store_true", help="decode shapes over a KV cache (see above)")
    ap.add_argument("--attn-decode-bench", default=os.path.join("build", "bench", "attn-decode-bench"))
    ap.add_argument("--shapes", default=DECODE_SHAPES, help="decode mode: B,H,Hkv,L,S,E;...")
    ap.add_argument("--ggml-driver", default="", help="decode mode: time ggml flash_attn_ext with this driver")
    ap.add_argument("--decode-window", type=int, default=-1,
                    help="decode mode: a causal sliding window of this many keys before each query (-1: none)")
    ap.add_argument("--layer", action="store_true", help="time the multi-head layers (see above)")
    ap.add_argument("--layer-dtype", default="float32", choices=["float32", "bfloat16", "bfloat16-params"],
                    help="--layer: bfloat16 = torch's layer in bfloat16 against attn's with compute_dtype bfloat16; "
                         "bfloat16-params: against attn's layer with bfloat16 parameters")
    ap.add_argument("--layer-shapes", default="8,128,256,4;4,512,512,8;1,2048,768,12",
                    help="layer and gemm modes: B,N,D,H;...")
    ap.add_argument("--gemm", action="store_true", help="the layer's GEMMs alone (see above)")
    ap.add_argument("--attn-gemm-bench", default=os.path.join("build", "bench", "attn-gemm-bench"))
    ap.add_argument("--variants", action="store_true", help="each variant against its dense torch form (see above)")
    ap.add_argument("--attn-bench-variants", default=os.path.join("build", "bench", "attn-bench-variants"))
    ap.add_argument("--variant-list", default=",".join(VARIANTS))
    ap.add_argument("--variant-len", type=int, default=2048)
    ap.add_argument("--variant-window", type=int, default=256)
    ap.add_argument("--softcap", type=float, default=30.0)
    ap.add_argument("--varlen-count", type=int, default=16)
    ap.add_argument("--varlen-max", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=2026)
    args, _ = ap.parse_known_args()
    if (args.layer or args.gemm or args.variants) and args.threads == "1,2":
        args.threads = "2"
    if args.layer and args.reps == 3:
        args.reps = 15
    if args.gemm and args.reps == 3:
        args.reps = 7

    try:
        import torch
    except Exception as e:  # ImportError, or a broken install (e.g. missing CUDA libraries)
        print(f"compare_torch: PyTorch is not installed or cannot be imported ({e}); nothing to compare.\n"
              "Install it (e.g. `pip install torch`) and run again.")
        return 0
    if args.layer:
        return main_layer(args, torch)
    if args.gemm:
        return gemm_main(args, torch)
    if args.variants:
        return variants_main(args, torch)
    if args.decode:
        if not os.path.exists(args.attn_decode_bench):
            print(f"compare_torch: {args.attn_decode_bench} not found; build first (`make build`).")
            return 1
        return decode_main(args, torch)
    if not os.path.exists(args.attn_bench):
        print(f"compare_torch: {args.attn_bench} not found; build first (`make build`).")
        return 1
    if args.dtype == "bfloat16":
        return bf16_main(args, torch)

    print(f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}), "
          f"attn-bench {args.attn_bench}")
    print(f"{'L=S':>6} {'mask':6} {'mode':7} {'th':>2} {'torch ms':>10} {'attn ms':>10} {'attn/torch':>10}  validation")
    rows = []
    for L in parse_list(args.lengths):
        for mode in args.modes.split(","):
            for causal in parse_list(args.causal):
                for threads in parse_list(args.threads):
                    t1 = time_torch(torch, L, bool(causal), mode, threads, args.reps)
                    a, check = time_attn(args.attn_bench, L, bool(causal), mode, threads)
                    t2 = time_torch(torch, L, bool(causal), mode, threads, args.reps)
                    t = statistics.median([t1, t2])
                    rows.append(dict(L=L, causal=bool(causal), mode=mode, threads=threads, torch_s=t, attn_s=a,
                                     ratio=a / t, validation=check))
                    print(f"{L:6d} {'causal' if causal else 'full':6} {mode:7} {threads:2d} {t * 1e3:10.2f} "
                          f"{a * 1e3:10.2f} {a / t:10.3f}  {check}", flush=True)
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"\nslowest relative to torch: L={worst['L']} {worst['mode']} causal={worst['causal']} "
          f"threads={worst['threads']}: attn/torch = {worst['ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, results=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
