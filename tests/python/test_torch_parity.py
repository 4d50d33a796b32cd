"""attn against PyTorch itself: torch.nn.functional.scaled_dot_product_attention
and its autograd gradients, and torch.nn.MultiheadAttention with the same
weights, over many random configurations. Skipped when PyTorch is not
installed (`make test-torch` installs it and runs this file).

Tolerances: every comparison must satisfy
    max |attn - torch| <= TOL[dtype] · max(1, max |torch|)
with TOL = 1e-5 for float32 and 1e-12 for float64 (PyTorch's CPU math path
accumulates in the input precision; attn's reference accumulates in double).
The largest errors seen per case are printed at the end of the run."""

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (run `make test-torch` to install it and run these)")
import torch.nn.functional as F  # noqa: E402

import attn  # noqa: E402
import attn.torch  # noqa: E402
import npref  # noqa: E402

TOL = {np.float32: 1e-5, np.float64: 1e-12}
TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64}
BACKENDS = ["reference", "auto"]


def check(parity, case, got, want, dtype):
    got = got.detach().numpy() if isinstance(got, torch.Tensor) else got
    want = want.detach().numpy()
    assert got.shape == want.shape, f"{case}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{case}: non-finite output"
    abs_err, _ = parity.record(case, got, want)
    bound = TOL[dtype] * max(1.0, float(np.abs(want).max()) if want.size else 0.0)
    assert abs_err <= bound, f"{case}: max abs error {abs_err:.3g} > {bound:.3g}"


def leaf(x):
    return None if x is None else torch.from_numpy(x.copy()).requires_grad_(x.dtype != np.bool_)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", npref.KINDS)
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_and_gradients_match_torch(dtype, kind, gqa, backend, parity):
    rng = np.random.default_rng(npref.seed_of(kind, gqa))
    for _ in range(8):
        # PyTorch's GQA path expects (N, H, L, E); attn takes any leading axes.
        c = npref.random_case(rng, dtype, kind, gqa, dead_rows=False, nlead=2 if gqa else None)
        kw = dict(is_causal=c["causal"], scale=c["scale"], enable_gqa=c["gqa"])
        ran = attn.resolve_backend(c["q"], c["k"], c["v"], c["mask"], backend=backend, **kw)
        label = backend if ran == backend else f"{backend}->{ran}"
        name = f"sdpa {np.dtype(dtype).name} {kind}{' gqa' if gqa else ''} [{label}]"
        tq, tk, tv, tm = (leaf(c[n]) for n in ("q", "k", "v", "mask"))
        want = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, **kw)
        aq, ak, av, am = (leaf(c[n]) for n in ("q", "k", "v", "mask"))
        got = attn.torch.scaled_dot_product_attention(aq, ak, av, am, backend=backend, **kw)
        assert isinstance(got, torch.Tensor) and got.dtype == TORCH_DTYPE[dtype]
        check(parity, name + " out", got, want, dtype)
        dout = torch.from_numpy(rng.standard_normal(tuple(want.shape)).astype(dtype))
        want.backward(dout)
        got.backward(dout)
        for n, a, t in (("dq", aq, tq), ("dk", ak, tk), ("dv", av, tv), ("dmask", am, tm)):
            if t is not None and t.requires_grad:
                check(parity, f"{name} {n}", a.grad, t.grad, dtype)


def test_tensors_in_tensors_out_and_autograd_entry():
    rng = np.random.default_rng(1)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 3, 5, 4))) for _ in range(3))
    out, lse = attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    want = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    # Non-contiguous tensors (a transposed (B, L, H, E) layout) through DLPack.
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    torch.testing.assert_close(attn.scaled_dot_product_attention(qt, k, v), out, rtol=0, atol=0)
    # The differentiable entry point is attn.torch's; the plain one refuses
    # tensors that require grad rather than dropping their graph.
    qg = q.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="use attn.torch.scaled_dot_product_attention"):
        attn.scaled_dot_product_attention(qg, k, v, is_causal=True)
    with torch.no_grad():
        torch.testing.assert_close(attn.scaled_dot_product_attention(qg, k, v), out, rtol=0, atol=0)
    y = attn.torch.scaled_dot_product_attention(qg, k, v, is_causal=True)
    assert y.requires_grad
    y.sum().backward()
    qr = q.clone().requires_grad_(True)
    F.scaled_dot_product_attention(qr, k, v, is_causal=True).sum().backward()
    torch.testing.assert_close(qg.grad, qr.grad, rtol=0, atol=1e-12)
    # Half precision: attn.torch answers in the inputs' dtype, like PyTorch; both round a
    # float32-accurate result once, so they differ by at most two roundings of the output.
    for dt in (torch.float16, torch.bfloat16):
        h = [x.to(dt) for x in (q, k, v)]
        got, want = attn.torch.scaled_dot_product_attention(*h), F.scaled_dot_product_attention(*h)
        assert got.dtype == dt
        bound = 2 * torch.finfo(dt).eps * want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=bound)
    # Unsupported dtypes and devices are refused by name.
    with pytest.raises(ValueError, match="'query' has dtype int32, expected float32, float64, float16 or bfloat16"):
        attn.scaled_dot_product_attention(q.int(), k.int(), v.int())
    with pytest.raises(ValueError, match="dropout_p"):  # dropout works (test_dropout.py); its range is checked
        attn.torch.scaled_dot_product_attention(q, k, v, dropout_p=1.5)


def test_torch_gradcheck():
    """torch.autograd.gradcheck (finite differences in float64) on the
    autograd Function, float mask included."""
    rng = np.random.default_rng(2)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, n, 3))).requires_grad_() for n in (3, 4, 4))
    m = torch.from_numpy(rng.standard_normal((2, 1, 4))).requires_grad_()
    fn = attn.torch.ScaledDotProductAttention.apply
    assert torch.autograd.gradcheck(lambda *a: fn(*a), (q, k, v, m))
    assert torch.autograd.gradcheck(lambda *a: fn(*a, None, 0.0, True), (q, k, v))


def test_swap_into_a_torch_model_and_train():
    """The README's pattern: a model whose attention call is swappable gives
    the same loss and parameter gradients with attn as with PyTorch."""

    class Block(torch.nn.Module):
        def __init__(self, sdpa):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)
            self.proj = torch.nn.Linear(16, 16)
            self.sdpa = sdpa

        def forward(self, x):  # x: (B, L, 16), 4 heads of 4
            B, L, _ = x.shape
            q, k, v = self.qkv(x).view(B, L, 3, 4, 4).permute(2, 0, 3, 1, 4)
            y = self.sdpa(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, L, 16))

    torch.manual_seed(0)
    ref = Block(F.scaled_dot_product_attention).double()
    ours = Block(attn.torch.scaled_dot_product_attention).double()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    for model in (ref, ours):
        model(x).pow(2).mean().backward()
    for (n, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12, msg=n)


def _mha_mask_kwargs(rng, masks, B, H, L, S, dtype):
    """nn.MultiheadAttention.forward keyword arguments for one mask kind
    (PyTorch polarity: True = blocked); column 0 is never blocked."""
    if masks == "bool":
        m = rng.random((L, S)) < 0.3
        m[:, 0] = False
        return {"attn_mask": torch.from_numpy(m)}
    if masks == "float":
        return {"attn_mask": torch.from_numpy(rng.standard_normal((L, S)).astype(dtype))}
    if masks == "per-head":
        m = rng.random((B * H, L, S)) < 0.3
        m[..., 0] = False
        return {"attn_mask": torch.from_numpy(m)}
    if masks == "kpm":
        m = rng.random((B, S)) < 0.3
        m[:, 0] = False
        return {"key_padding_mask": torch.from_numpy(m)}
    if masks == "causal":
        return {"attn_mask": torch.triu(torch.ones(L, L, dtype=torch.bool), 1), "is_causal": True}
    return {}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "bool", "float", "kpm", "per-head", "causal"])
def test_multihead_matches_torch(dtype, packed, batch_first, masks, parity):
    """nn.MultiheadAttention with random weights copied into attn: outputs and
    attention weights (averaged and per head), self- and cross-attention."""
    rng = np.random.default_rng(npref.seed_of(packed, batch_first, masks))
    torch.manual_seed(int(rng.integers(0, 2**31)))
    name = f"mha {np.dtype(dtype).name} {'packed' if packed else 'kdim/vdim'} {masks}"
    for trial in range(6):
        D, H = [(8, 2), (12, 3), (6, 1), (16, 4)][trial % 4]
        kdim, vdim = (None, None) if packed else (int(rng.integers(3, 10)), int(rng.integers(3, 10)))
        bias = trial % 3 != 2
        ref = torch.nn.MultiheadAttention(D, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                          dtype=TORCH_DTYPE[dtype])
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randn_like(p) * 0.5)
        ours = attn.MultiheadAttention(D, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                       dtype=dtype)
        ours.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
        B, L = int(rng.integers(1, 4)), int(rng.integers(1, 9))
        S = L if (packed and trial % 2 == 0) or masks == "causal" else int(rng.integers(1, 9))

        def inp(n, width):
            shape = (B, n, width) if batch_first else (n, B, width)
            return torch.from_numpy(rng.standard_normal(shape).astype(dtype))

        q = inp(L, D)
        if packed and trial % 2 == 0:
            k = v = q  # self-attention
        else:
            k, v = inp(S, ours.kdim), inp(S, ours.vdim)
        kw = _mha_mask_kwargs(rng, masks, B, H, L, S, dtype)
        for avg in (True, False):
            with torch.no_grad():
                want, want_w = ref(q, k, v, average_attn_weights=avg, **kw)
            got, got_w = ours(q, k, v, average_attn_weights=avg, **kw)
            assert isinstance(got, torch.Tensor)
            check(parity, name + " out", got, want, dtype)
            check(parity, name + (" weights avg" if avg else " weights per-head"), got_w, want_w, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "bool", "float", "kpm", "per-head", "causal"])
def test_multihead_gradients_match_torch(dtype, packed, batch_first, masks, parity):
    """attn.MultiheadAttention.backward against torch autograd through
    nn.MultiheadAttention with the same weights: the gradients of query, key
    and value (self-attention: the one input's total) and of every parameter."""
    rng = np.random.default_rng(npref.seed_of("grad", packed, batch_first, masks))
    torch.manual_seed(int(rng.integers(0, 2**31)))
    name = f"mha grad {np.dtype(dtype).name} {'packed' if packed else 'kdim/vdim'} {masks}"
    for trial in range(4):
        D, H = [(8, 2), (12, 3), (6, 1), (16, 4)][trial % 4]
        kdim, vdim = (None, None) if packed else (int(rng.integers(3, 10)), int(rng.integers(3, 10)))
        bias = trial % 3 != 2
        ref = torch.nn.MultiheadAttention(D, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                          dtype=TORCH_DTYPE[dtype])
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randn_like(p) * 0.5)
        ours = attn.MultiheadAttention(D, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                       dtype=dtype)
        ours.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
        self_attention = packed and trial % 2 == 0
        B, L = int(rng.integers(1, 4)), int(rng.integers(1, 9))
        S = L if self_attention or masks == "causal" else int(rng.integers(1, 9))

        def inp(n, width):
            shape = (B, n, width) if batch_first else (n, B, width)
            return torch.from_numpy(rng.standard_normal(shape).astype(dtype)).requires_grad_()

        q = inp(L, D)
        k, v = (q, q) if self_attention else (inp(S, ours.kdim), inp(S, ours.vdim))
        kw = _mha_mask_kwargs(rng, masks, B, H, L, S, dtype)
        want, _ = ref(q, k, v, need_weights=False, **kw)
        dout = torch.from_numpy(rng.standard_normal(tuple(want.shape)).astype(dtype))
        want.backward(dout)

        ins = (q.detach(),) * 3 if self_attention else tuple(x.detach() for x in (q, k, v))
        got, _ = ours(*ins, need_weights=False, **kw)
        check(parity, name + " out", got, want, dtype)
        g = ours.backward(dout)
        check(parity, name + " dquery", g["query"], q.grad, dtype)
        if self_attention:
            assert g["key"] is None and g["value"] is None
        else:
            check(parity, name + " dkey", g["key"], k.grad, dtype)
            check(parity, name + " dvalue", g["value"], v.grad, dtype)
        grads = ours.grads()
        assert sorted(grads) == sorted(n for n, _ in ref.named_parameters())
        for n, p in ref.named_parameters():
            check(parity, f"{name} d{n}", grads[n], p.grad, dtype)


def test_numpy_mask_with_tensors_and_mha_autograd_guard():
    rng = np.random.default_rng(3)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, 4, 3))).requires_grad_() for _ in range(3))
    m = rng.standard_normal((4, 4))  # a NumPy float mask next to tensors
    y = attn.torch.scaled_dot_product_attention(q, k, v, m)
    y.sum().backward()
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    F.scaled_dot_product_attention(qr, kr, vr, torch.from_numpy(m)).sum().backward()
    for a, b in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    layer = attn.MultiheadAttention(6, 2, dtype=torch.float64)
    x = torch.randn(3, 1, 6, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="does not take part in torch autograd"):
        layer(x, x, x)
    with torch.no_grad():
        out, _ = layer(x, x, x)
    assert out.shape == (3, 1, 6)
