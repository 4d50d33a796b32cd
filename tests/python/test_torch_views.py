"""torch tensors whose values DLPack does not describe: lazy negation and
conjugation bits are resolved before attn reads the memory, and dtypes or
layouts attn cannot take are a ValueError naming the argument. Skipped when
PyTorch is not installed."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import attn  # noqa: E402
import attn.torch  # noqa: E402
import npref  # noqa: E402


def qkv(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 5, 4, generator=g, dtype=dtype) for _ in range(3)]


def reference(q, k, v, mask=None):
    """The plain computation, in NumPy double, from materialised copies."""
    as_np = [np.array(t.resolve_neg().resolve_conj().tolist(), dtype=np.float64) for t in (q, k, v)]
    return npref.sdpa(*as_np, mask=None if mask is None else np.array(mask.tolist(), dtype=bool))[0]


def neg_view(t):
    """A tensor with the negative bit set: the imaginary part of a conjugate
    view is -imag(c), stored as imag(c) with the bit."""
    c = torch.complex(torch.zeros_like(t), -t)
    n = c.conj().imag
    assert n.is_neg(), "torch no longer sets the negative bit here"
    return n


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_negative_bit_tensors_are_read_with_their_sign(which, backend):
    args = qkv(which)
    args[which] = neg_view(args[which])
    want = reference(*args)
    assert np.abs(want).max() > 0.1
    got = attn.scaled_dot_product_attention(*args, backend=backend)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-12)
    via_torch = attn.torch.scaled_dot_product_attention(*args, backend=backend)
    np.testing.assert_allclose(via_torch.detach().numpy(), want, rtol=0, atol=1e-12)


def test_gradients_of_negative_bit_tensors():
    q, k, v = qkv(3)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    # torch.neg of a leaf in the graph: the backward's grad_output may itself carry the bit.
    y = attn.torch.scaled_dot_product_attention(*leaves)
    (-y).sum().backward()
    want = [t.grad.clone() for t in leaves]
    leaves2 = [t.clone().requires_grad_(True) for t in (q, k, v)]
    y2 = torch.nn.functional.scaled_dot_product_attention(*leaves2)
    (-y2).sum().backward()
    for a, b in zip(want, leaves2):
        np.testing.assert_allclose(a.numpy(), b.grad.numpy(), rtol=0, atol=1e-10)


def test_negative_bit_grad_output_in_backward():
    q, k, v = qkv(4)
    out, lse = attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    g = torch.randn(2, 5, 4, dtype=torch.float64)
    gn = neg_view(g)  # the values of g, stored as -g with the bit
    got = attn.scaled_dot_product_attention_backward(gn, q, k, v, output=out, lse=lse)
    want = attn.scaled_dot_product_attention_backward(g.clone(), q, k, v, output=out, lse=lse)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_taken_by_the_dense_call_only(dtype):
    """The dense call reads half q, k, v in place (test_half.py checks the values); the
    calls that have no half path refuse them, naming the argument."""
    q, k, v = qkv(5, torch.float32)
    h = [x.to(dtype) for x in (q, k, v)]
    out = attn.scaled_dot_product_attention(*h)
    assert out.dtype == torch.float32
    products = dict(compute_dtype="bfloat16") if dtype == torch.bfloat16 else {}  # bfloat16's default
    assert torch.equal(out, attn.scaled_dot_product_attention(*[x.float() for x in h], **products))
    assert attn.torch.scaled_dot_product_attention(*h).dtype == dtype
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    name = str(other).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"'key' has dtype {name}, expected {str(dtype).removeprefix('torch.')}"):
        attn.scaled_dot_product_attention(h[0], k.to(other), h[2])
    cu = torch.tensor([0, 5], dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"'q' has dtype {dtype}, expected torch.float32 or torch.float64"):
        attn.varlen_attention(h[0][0], h[1][0], h[2][0], cu, cu, 5, 5)


def test_sparse_tensors_are_a_value_error():
    q, k, v = qkv(6)
    with pytest.raises(ValueError, match=r"'key' has layout torch.sparse_coo, expected a dense"):
        attn.scaled_dot_product_attention(q, k.to_sparse(), v)
