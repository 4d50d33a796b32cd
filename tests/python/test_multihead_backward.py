"""attn.MultiheadAttention.backward: input and parameter gradients against
central finite differences in float64 (every element, small shapes), over
layouts, masks, causal attention and kdim/vdim != embed_dim; float32 against
float64; self-attention's summed gradient; accumulation, zero_grad,
retain_graph; the saved masks outliving the caller's arrays; errors."""

import gc

import numpy as np
import pytest

import attn


def randomize(layer, rng, scale=0.5):
    """Random parameters (biases included, so their gradients are not trivial)."""
    sd = {n: rng.standard_normal(a.shape) * scale for n, a in layer.state_dict().items()}
    layer.load_state_dict(sd)
    return sd


def loss(layer, args, kw, dout):
    out, _ = layer(*args, need_weights=False, **kw)
    return float(np.sum(np.asarray(out, np.float64) * dout))


def numeric_input_grads(layer, args, kw, dout, h=1e-6):
    """d loss / d args[i], element by element. Arrays passed more than once
    (self-attention) are perturbed once, so the result is their total gradient."""
    grads = []
    seen = []
    for a in args:
        if any(a is s for s in seen):
            grads.append(None)
            continue
        seen.append(a)
        g = np.zeros_like(a)
        for i in range(a.size):
            old = a.flat[i]
            a.flat[i] = old + h
            up = loss(layer, args, kw, dout)
            a.flat[i] = old - h
            down = loss(layer, args, kw, dout)
            a.flat[i] = old
            g.flat[i] = (up - down) / (2 * h)
        grads.append(g)
    return grads


def numeric_param_grads(layer, args, kw, dout, h=1e-6):
    sd = layer.state_dict()
    grads = {}
    for name, p in sd.items():
        g = np.zeros_like(p)
        for i in range(p.size):
            old = p.flat[i]
            p.flat[i] = old + h
            layer.load_state_dict(sd)
            up = loss(layer, args, kw, dout)
            p.flat[i] = old - h
            layer.load_state_dict(sd)
            down = loss(layer, args, kw, dout)
            p.flat[i] = old
            g.flat[i] = (up - down) / (2 * h)
        grads[name] = g
    layer.load_state_dict(sd)
    return grads


def assert_fd_close(got, want, what):
    # Central differences with h = 1e-6 in float64: truncation ~h², rounding
    # ~eps·|loss|/h ~1e-10 here; an analytic error shows up far above 1e-7.
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * max(1.0, np.abs(want).max()), err_msg=what)


def user_layout(x, batched, batch_first):
    """(B, N, width) data in the layer's input layout."""
    if not batched:
        return np.ascontiguousarray(x[0])
    return x if batch_first else np.ascontiguousarray(x.transpose(1, 0, 2))


# name: (packed, batch_first, batched, self_attention, masks, bias)
CASES = {
    "self seq-first": (True, False, True, True, "none", True),
    "self causal unbatched": (True, False, False, True, "causal", True),
    "cross batch_first bool mask": (True, True, True, False, "bool", True),
    "cross kdim/vdim kpm": (False, False, True, False, "kpm", True),
    "cross kdim/vdim float mask no bias": (False, True, True, False, "float", False),
    "self per-head mask + float kpm": (True, True, True, True, "per-head+float-kpm", True),
    "cross kdim/vdim causal + kpm unbatched": (False, True, False, False, "causal+kpm", True),
}


def make_case(rng, packed, batch_first, batched, self_attention, masks, bias, dtype=np.float64):
    D, H = (6, 2) if packed else (4, 2)
    kdim, vdim = (None, None) if packed else (5, 3)
    layer = attn.MultiheadAttention(D, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                    dtype=dtype, seed=4)
    sd = randomize(layer, rng)
    B = 2 if batched else 1
    L = 3
    S = L if (self_attention or "causal" in masks) else 4
    xq = rng.standard_normal((B, L, D))
    if self_attention:
        x = user_layout(xq, batched, batch_first).astype(dtype)
        args = (x, x, x)
    else:
        xk = rng.standard_normal((B, S, layer.kdim))
        xv = rng.standard_normal((B, S, layer.vdim))
        args = tuple(user_layout(a, batched, batch_first).astype(dtype) for a in (xq, xk, xv))
    kw = {}
    if "causal" in masks:
        kw["is_causal"] = True
    if masks == "bool":
        m = rng.random((L, S)) < 0.4  # True = blocked
        m[:, 1] = False
        kw["attn_mask"] = m
    elif masks == "float":
        kw["attn_mask"] = rng.standard_normal((L, S)).astype(dtype)
    elif masks.startswith("per-head"):
        m = rng.random((B * H, L, S)) < 0.4
        m[..., 0] = False
        kw["attn_mask"] = m
    if "float-kpm" in masks:
        kw["key_padding_mask"] = np.where(rng.random((B, S)) < 0.3, -np.inf, 0.0).astype(dtype)
    elif "kpm" in masks:
        p = rng.random((B, S)) < 0.4
        p[:, 0] = False
        kw["key_padding_mask"] = p if batched else p[0]
    out, _ = layer(*args, need_weights=False, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    return layer, sd, args, kw, dout


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_finite_differences(case):
    rng = np.random.default_rng(sum(map(ord, case)))
    layer, _, args, kw, dout = make_case(rng, *CASES[case])
    self_attention = CASES[case][3]

    layer.zero_grad()
    out, _ = layer(*args, **kw)
    got = layer.backward(dout)
    got_params = layer.grads()

    want = numeric_input_grads(layer, args, kw, dout)
    want_params = numeric_param_grads(layer, args, kw, dout)

    assert sorted(got) == ["key", "query", "value"]
    if self_attention:
        assert got["key"] is None and got["value"] is None
    for name, w in zip(("query", "key", "value"), want):
        if w is None:
            continue
        assert got[name].dtype == np.float64
        assert np.abs(w).max() > 1e-3, f"{case}: the gradient of '{name}' is trivially small"
        assert_fd_close(got[name], w, f"{case}: d{name}")
    assert sorted(got_params) == sorted(layer.parameter_names())
    for name, w in want_params.items():
        assert np.abs(w).max() > 1e-3, f"{case}: the gradient of '{name}' is trivially small"
        assert_fd_close(got_params[name], w, f"{case}: d{name}")


def test_self_attention_gradient_is_the_sum_of_the_three_paths():
    rng = np.random.default_rng(21)
    layer = attn.MultiheadAttention(8, 2, dtype=np.float64, seed=1)
    randomize(layer, rng)
    x = rng.standard_normal((5, 3, 8))
    dout = rng.standard_normal((5, 3, 8))
    layer(x, x, x, is_causal=True)
    g_self = layer.backward(dout)
    p_self = layer.grads()
    layer.zero_grad()
    layer(x, x.copy(), x.copy(), is_causal=True)
    g_sep = layer.backward(dout)
    p_sep = layer.grads()
    assert g_self["key"] is None and g_self["value"] is None
    total = g_sep["query"] + g_sep["key"] + g_sep["value"]
    np.testing.assert_allclose(g_self["query"], total, rtol=0, atol=1e-12 * np.abs(total).max())
    assert np.abs(g_sep["key"]).max() > 1e-2  # the three parts really differ from the total
    for n in p_self:
        np.testing.assert_allclose(p_self[n], p_sep[n], rtol=0, atol=1e-12 * max(1, np.abs(p_sep[n]).max()))


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_float32_matches_float64(packed, batch_first):
    rng = np.random.default_rng(int(packed) * 2 + int(batch_first))
    D, H = 16, 4
    kdim, vdim = (None, None) if packed else (7, 9)
    l64 = attn.MultiheadAttention(D, H, kdim=kdim, vdim=vdim, batch_first=batch_first, dtype=np.float64)
    l32 = attn.MultiheadAttention(D, H, kdim=kdim, vdim=vdim, batch_first=batch_first, dtype=np.float32)
    sd = randomize(l64, rng)
    l32.load_state_dict(sd)
    B, L, S = 3, 9, 11

    def inp(n, w):
        return user_layout(rng.standard_normal((B, n, w)), True, batch_first)

    q, k, v = inp(L, D), inp(S, l64.kdim), inp(S, l64.vdim)
    kpm = rng.random((B, S)) < 0.3
    kpm[:, 0] = False
    dout = rng.standard_normal(q.shape)
    l64(q, k, v, key_padding_mask=kpm)
    g64 = l64.backward(dout)
    l32(*(a.astype(np.float32) for a in (q, k, v)), key_padding_mask=kpm)
    g32 = l32.backward(dout.astype(np.float32))
    p64, p32 = l64.grads(), l32.grads()
    for name in g64:
        assert g32[name].dtype == np.float32 and g32[name].shape == g64[name].shape
        np.testing.assert_allclose(g32[name], g64[name], rtol=0, atol=2e-5 * np.abs(g64[name]).max(),
                                   err_msg=name)
    for name in p64:
        assert p32[name].dtype == np.float32
        np.testing.assert_allclose(p32[name], p64[name], rtol=0, atol=2e-5 * np.abs(p64[name]).max(),
                                   err_msg=name)


def test_accumulation_zero_grad_and_retain_graph():
    rng = np.random.default_rng(8)
    layer = attn.MultiheadAttention(6, 3, batch_first=True, dtype=np.float64, seed=0)
    randomize(layer, rng)
    x = rng.standard_normal((2, 4, 6))
    dout = rng.standard_normal((2, 4, 6))
    assert all(np.all(g == 0) for g in layer.grads().values())  # a new layer starts at zero
    layer(x, x, x)
    first = layer.backward(dout)
    once = layer.grads()
    layer(x, x, x)
    second = layer.backward(dout)
    np.testing.assert_array_equal(second["query"], first["query"])  # input grads are not accumulated
    for n, g in layer.grads().items():
        np.testing.assert_allclose(g, 2 * once[n], rtol=1e-15, atol=0)
    layer.zero_grad()
    assert all(np.all(g == 0) for g in layer.grads().values())
    # retain_graph keeps the forward's state for another backward.
    layer(x, x, x)
    a = layer.backward(dout, retain_graph=True)
    b = layer.backward(2 * dout)
    np.testing.assert_allclose(b["query"], 2 * a["query"], rtol=1e-14, atol=0)
    for n, g in layer.grads().items():
        np.testing.assert_allclose(g, 3 * once[n], rtol=1e-14, atol=1e-15)
    with pytest.raises(ValueError, match="no forward call to differentiate"):
        layer.backward(dout)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_grad_forward_keeps_nothing(dtype):
    """Under torch.no_grad() and torch.inference_mode() forward gives the same
    bits and saves no state: backward() still differentiates the last forward
    that ran with gradients enabled, and raises when there is none."""
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    rng = np.random.default_rng(9)
    layer = attn.MultiheadAttention(8, 2, batch_first=True, dtype=tdt, seed=1)
    x = torch.from_numpy(rng.standard_normal((2, 5, 8)).astype(np.float32)).to(tdt)
    y = torch.from_numpy(rng.standard_normal((2, 5, 8)).astype(np.float32)).to(tdt)
    dout = torch.from_numpy(rng.standard_normal((2, 5, 8)).astype(np.float32)).to(tdt)
    with torch.no_grad():
        quiet, _ = layer(x, x, x, need_weights=False)
    with pytest.raises(ValueError, match=r"ran under torch.no_grad\(\) or torch.inference_mode\(\), saves none"):
        layer.backward(dout)
    out, _ = layer(x, x, x, need_weights=False)
    assert torch.equal(quiet, out)
    want = layer.backward(dout, retain_graph=True)["query"]
    layer.zero_grad()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            other, _ = layer(y, y, y, need_weights=False)  # another input, kept nowhere
        assert not torch.equal(other, out)
    got = layer.backward(dout)["query"]  # still the gradient of the forward on x
    assert torch.equal(got, want)
    assert any(bool((g != 0).any()) for g in layer.grads().values())
    with pytest.raises(ValueError, match="no forward call to differentiate"):
        layer.backward(dout)


def test_dead_rows_get_zero_gradient():
    """A batch whose keys are all padding: its output rows are out_proj.bias
    and nothing flows back to its query, key or value."""
    rng = np.random.default_rng(13)
    layer = attn.MultiheadAttention(4, 2, kdim=3, vdim=5, batch_first=True, dtype=np.float64)
    sd = randomize(layer, rng)
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 4, 5))
    kpm = np.zeros((2, 4), bool)
    kpm[1] = True
    out, _ = layer(q, k, v, key_padding_mask=kpm)
    np.testing.assert_allclose(out[1], np.broadcast_to(sd["out_proj.bias"], (3, 4)), rtol=0, atol=1e-15)
    g = layer.backward(np.ones_like(out))
    for n in ("query", "key", "value"):
        assert np.all(g[n][1] == 0), n
        assert np.abs(g[n][0]).max() > 1e-3, n
    assert np.all(np.isfinite(layer.grads()["q_proj_weight"]))


def test_masks_outlive_the_callers_arrays():
    """The saved state holds the mask arrays, so backward is right even when
    the caller's masks (and the layer's temporaries) are gone."""
    rng = np.random.default_rng(17)
    layer = attn.MultiheadAttention(8, 2, dtype=np.float64, seed=2)
    randomize(layer, rng)
    x = rng.standard_normal((6, 2, 8))
    mask = rng.random((6, 6)) < 0.5
    np.fill_diagonal(mask, False)
    bias = rng.standard_normal((6, 6))
    dout = rng.standard_normal((6, 2, 8))
    want = []
    for m in (mask, bias):
        layer.zero_grad()
        layer(x, x, x, attn_mask=m)
        want.append((layer.backward(dout)["query"], layer.grads()))
    for i, m in enumerate((mask, bias)):
        layer.zero_grad()
        layer(x, x, x, attn_mask=m.copy())  # the copy and the inverted bool mask die here
        gc.collect()
        # Allocations of the same sizes reuse the masks' memory if it was freed.
        junk = [np.full((6, 6), 7.0) for _ in range(64)] + [np.zeros((6, 6), bool) for _ in range(64)]
        got = layer.backward(dout)["query"]
        del junk
        np.testing.assert_array_equal(got, want[i][0])
        for n, g in layer.grads().items():
            np.testing.assert_array_equal(g, want[i][1][n])


def test_backward_errors():
    layer = attn.MultiheadAttention(8, 2, seed=0)
    x = np.random.default_rng(0).standard_normal((3, 2, 8)).astype(np.float32)
    dout = np.ones((3, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"attn.MultiheadAttention.backward: there is no forward call"):
        layer.backward(dout)
    layer(x, x, x)
    with pytest.raises(ValueError, match=r"'grad_output' has shape \(2, 3, 8\), expected \(3, 2, 8\)"):
        layer.backward(np.ones((2, 3, 8), np.float32))
    with pytest.raises(ValueError, match=r"'grad_output' has dtype float64, expected float32"):
        layer.backward(dout.astype(np.float64))
    # A rejected grad_output leaves the saved state usable.
    g = layer.backward(dout)
    assert g["query"].shape == (3, 2, 8)
    with pytest.raises(ValueError, match="no forward call to differentiate"):
        layer.backward(dout)
    # A forward that fails saves nothing, not even the previous call's state.
    layer(x, x, x)
    with pytest.raises(ValueError, match="'mask' has shape"):
        layer(x, x, x, attn_mask=np.zeros((4, 3), bool))
    with pytest.raises(ValueError, match="no forward call to differentiate"):
        layer.backward(dout)
    # New weights between forward and backward.
    layer(x, x, x)
    layer.load_state_dict(layer.state_dict())
    with pytest.raises(ValueError, match="changed by load_state_dict"):
        layer.backward(dout)
    # Unbatched: grad_output is (L, E).
    layer(x[:, 0], x[:, 0], x[:, 0])
    with pytest.raises(ValueError, match=r"'grad_output' has shape \(3, 2, 8\), expected \(3, 8\)"):
        layer.backward(dout)
    assert layer.backward(dout[:, 0])["query"].shape == (3, 8)
    # The extension refuses a cache that no forward filled.
    with pytest.raises(ValueError, match="argument 'cache' is empty"):
        layer._layer.backward(attn._attn.MhaSavedF32(), dout)


def test_sgd_steps_fit_a_target():
    """The README's training loop: plain gradient descent on the layer's own
    gradients drives the loss of a reachable target (another layer's output)
    down by orders of magnitude."""
    rng = np.random.default_rng(31)
    teacher = attn.MultiheadAttention(8, 2, batch_first=True, dtype=np.float64, seed=5)
    randomize(teacher, rng)
    student = attn.MultiheadAttention(8, 2, batch_first=True, dtype=np.float64, seed=6)
    x = rng.standard_normal((4, 6, 8))
    target, _ = teacher(x, x, x, is_causal=True)
    losses = []
    for _ in range(300):
        y, _ = student(x, x, x, is_causal=True, need_weights=False)
        losses.append(float(np.mean((y - target) ** 2)))
        student.zero_grad()
        student.backward(2 * (y - target) / y.size)
        sd = student.state_dict()
        for n, g in student.grads().items():
            sd[n] -= 0.5 * g
        student.load_state_dict(sd)
    assert losses[-1] < 0.05 * losses[0], (losses[0], losses[-1])
    assert all(b <= a * (1 + 1e-9) for a, b in zip(losses[:20], losses[1:21]))  # small steps: monotone at first
