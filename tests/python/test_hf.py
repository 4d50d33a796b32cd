"""attn inside transformers models (attn.hf): tiny randomly initialised models
of each family built here (no download), run with attn_implementation="attn"
against transformers' own "eager" and "sdpa" implementations with the same
weights.

Families and what they exercise:
  llama    grouped-query heads (4 over 2), RoPE, causal
  mistral  sliding window (5 keys, prompts of 12)
  qwen2    sliding window on some layers only
  gemma2   soft-capped scores, query_pre_attn_scalar scaling, sliding/full layers
  gpt_oss  sinks (learned, with gradient), sliding/full layers
  bert     bidirectional, padding mask
  gpt2     multi-head, causal, learned positions

Bounds, derived from where the implementations differ: both run the same
torch operations everywhere but in attention, where attn reorders the
reductions (online softmax over key blocks, float32 accumulation). A
reordered reduction of n terms errs by at most about n·eps relative to the
sum of their magnitudes; per layer the scores reduce over E = 16 and the
values over S <= 16 keys, and the logits then reduce over the width
D = 64, so with Nl = 2 layers
    |logits_attn - logits_ref| <= (Nl·(E + S) + D) · eps · max(1, max |logits_ref|)
= 128·eps·scale: 1.5e-5·scale in float32. In bfloat16 every attention output
is rounded to bfloat16 in both, but from float32 values that differ by the
above, so one rounding in 2^8 can flip: an error of one bfloat16 ulp of the
attention output, carried through two layers with gain of order one, is
bounded by
    4 · Nl · eps_bf16 · max(1, max |logits_ref|)
(eps_bf16 = 2^-7). Gradients of every parameter (training mode, dropout 0)
obey the float32 bound relative to that parameter's largest gradient, with
the backward's extra reduction over L (factor 2).

Greedy generation: tokens must be identical while the reference's margin
between its best and second-best logit exceeds twice the logit bound (below
that, either token is a correct answer); the test requires most steps to
have that margin, so it cannot pass by skipping them.
"""

import copy

import numpy as np

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (`make test-models` installs it)")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (`make test-models` installs it)")

import attn.hf  # noqa: E402
import attn.torch  # noqa: E402

attn.hf.register()

VOCAB, WIDTH, LAYERS, HEAD_DIM, MAX_KEYS = 97, 64, 2, 16, 16
F32_BOUND = (LAYERS * (HEAD_DIM + MAX_KEYS) + WIDTH) * torch.finfo(torch.float32).eps
BF16_BOUND = 4 * LAYERS * torch.finfo(torch.bfloat16).eps

_DECODER = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=128,
                initializer_range=0.2, attention_dropout=0.0)

# name: (config class, config arguments, reference implementations, generative)
FAMILIES = {
    "llama": ("LlamaConfig", {}, ("eager", "sdpa"), True),
    "mistral": ("MistralConfig", dict(sliding_window=5), ("eager", "sdpa"), True),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                  layer_types=["full_attention", "sliding_attention"]), ("eager", "sdpa"), True),
    # transformers' sdpa refuses a softcap, and ignores gpt-oss's sinks: eager is their reference.
    "gemma2": ("Gemma2Config", dict(sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=None), ("eager",), True),
    # Every expert routed: with top-2 routing a bfloat16 rounding that flips a token's experts moved
    # the logits by far more than attention's bound (seen on a Zen 4 against eager).
    "gpt_oss": ("GptOssConfig", dict(sliding_window=5, num_local_experts=4, num_experts_per_tok=4),
                ("eager",), True),
    "bert": ("BertConfig", dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=64,
                                initializer_range=0.2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
             ("eager", "sdpa"), False),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=4, n_positions=64,
                                initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             ("eager", "sdpa"), True),
}


def config(family):
    cls, extra, _, _ = FAMILIES[family]
    args = dict(extra) if family in ("bert", "gpt2") else {**_DECODER, **extra}
    return getattr(transformers, cls)(**args)


def build(family, impl, dtype=torch.float32, cfg=None):
    """The family's tiny model with the weights of seed 0, in `dtype`."""
    cfg = copy.deepcopy(cfg if cfg is not None else config(family))
    auto = transformers.AutoModelForCausalLM if FAMILIES[family][3] else transformers.AutoModel
    torch.manual_seed(0)
    model = auto.from_config(cfg, attn_implementation=impl)
    if family == "gpt_oss":  # the sinks start at zero; give them values that matter
        for layer in model.model.layers:
            layer.self_attn.sinks.data.normal_(0.0, 1.0)
    if model.can_generate():  # generate every step asked for: no end-of-sequence token
        model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


def batch(seed=1, lengths=(12, 9, 7), left=False):
    """Token ids (B, 12) and the attention mask of a batch of `lengths` real
    tokens, padded on the right (or the left)."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), n), generator=g)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, m in enumerate(lengths):
        if left:
            mask[b, n - m:] = 1
        else:
            mask[b, :m] = 1
    return ids, mask


def outputs(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def assert_close(got, want, real, bound, what):
    """max |got - want| over the real tokens' rows <= bound · max(1, max |want|)."""
    got, want = got.float()[real.bool()], want.float()[real.bool()]
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = float((got - want).abs().max())
    limit = bound * max(1.0, float(want.abs().max()))
    assert err <= limit, f"{what}: max abs error {err:.3g} > {limit:.3g}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_outputs_match_transformers_float32(family, left):
    ids, mask = batch(left=left)
    with torch.no_grad():
        got = outputs(build(family, "attn"), ids, mask)
        for ref in FAMILIES[family][2]:
            assert_close(got, outputs(build(family, ref), ids, mask), mask, F32_BOUND, f"{family} vs {ref}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_outputs_match_transformers_bfloat16(family):
    ids, mask = batch()
    with torch.no_grad():
        got = outputs(build(family, "attn", torch.bfloat16), ids, mask)
        assert got.dtype == torch.bfloat16
        for ref in FAMILIES[family][2]:
            want = outputs(build(family, ref, torch.bfloat16), ids, mask)
            assert_close(got, want, mask, BF16_BOUND, f"{family} bfloat16 vs {ref}")


def greedy(model, ids, mask, steps, **kw):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


def assert_same_tokens(got, want, want_logits, bound, what, least=0.5):
    """Greedy tokens identical to the reference's, or differing first at a step
    where the reference's top-2 margin is within 2·bound·max|logits| (there
    either token is right, and the sequences part); at least a fraction
    `least` of all steps must be identical."""
    top2 = want_logits.float().topk(2, dim=-1).values
    scale = want_logits.float().abs().amax(dim=-1).clamp(min=1.0)
    close = (top2[..., 0] - top2[..., 1]) <= 2 * bound * scale  # (B, steps)
    same = 0
    for b in range(got.shape[0]):
        differ = (got[b] != want[b]).nonzero()
        if len(differ) == 0:
            same += got.shape[1]
            continue
        i = int(differ[0])
        assert close[b, i], (f"{what}: sequence {b} differs at step {i} where the reference's margin is clear: "
                             f"{got[b].tolist()} vs {want[b].tolist()}")
        same += i
    assert same >= least * got.numel(), f"{what}: only {same} of {got.numel()} steps identical"


GENERATIVE = sorted(f for f in FAMILIES if FAMILIES[f][3])


@pytest.mark.parametrize("family", GENERATIVE)
def test_greedy_generation_matches(family):
    ids, mask = batch(seed=2, left=True)
    with torch.no_grad():
        got, _ = greedy(build(family, "attn"), ids, mask, 10)
        for ref in FAMILIES[family][2]:
            want, logits = greedy(build(family, ref), ids, mask, 10)
            assert_same_tokens(got, want, logits, F32_BOUND, f"{family} vs {ref}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_gradients_match(family):
    """Every parameter's gradient in training mode (dropout 0) against the
    first reference, on a right-padded batch (the padding reaches attn as
    per-sequence key ranges, under autograd)."""
    ids, mask = batch(seed=3)
    labels = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(4))
    ref = FAMILIES[family][2][-1]
    grads = {}
    for impl in ("attn", ref):
        model = build(family, impl).train()
        out = outputs(model, ids, mask)
        if out.shape[-1] == VOCAB:
            loss = torch.nn.functional.cross_entropy(out[mask.bool()], labels[mask.bool()])
        else:  # bert: a fixed projection of the real tokens' states
            loss = (out[mask.bool()] * torch.linspace(-1, 1, out.shape[-1])).sum()
        loss.backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["attn"].keys() == grads[ref].keys()
    for name, want in grads[ref].items():
        got = grads["attn"][name]
        err = float((got - want).abs().max())
        # A bias's gradient is the sum of the rows that make its weight's gradient;
        # a key bias's is exactly 0 (a softmax does not see a constant added to a
        # row), so it is held to the scale of those rows, its weight's gradient.
        scale = max(float(want.abs().max()), float(grads[ref].get(name[:-4] + "weight", want).abs().max())
                    if name.endswith("bias") else 0.0, 1e-3)
        limit = 2 * F32_BOUND * scale
        assert err <= limit, f"{family} gradient of {name}: max abs error {err:.3g} > {limit:.3g}"
    if family == "gpt_oss":  # the sinks' gradient arrives
        assert all(float(grads["attn"][n].abs().max()) > 0 for n in grads["attn"] if n.endswith("sinks"))


# -- what reaches the kernel ----------------------------------------------------


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records the arguments of every attn.torch.scaled_dot_product_attention call."""
    calls = []
    real = attn.torch.scaled_dot_product_attention

    def recorder(query, key, value, attn_mask=None, **kw):
        calls.append(dict(query=tuple(query.shape), key=tuple(key.shape), attn_mask=attn_mask, **kw))
        return real(query, key, value, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(attn.torch, "scaled_dot_product_attention", recorder)
    return calls


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "bert"])
def test_no_dense_mask_reaches_the_kernel(family, kernel_calls):
    """Causal, sliding-window, right- and left-padded batches reach attn as
    rules and key ranges: no (L, S) mask, and each sequence's call sees only
    its real keys."""
    lengths = (12, 9, 7)
    model = build(family, "attn")
    for left in (False, True):
        ids, mask = batch(lengths=lengths, left=left)
        kernel_calls.clear()
        with torch.no_grad():
            outputs(model, ids, mask)
        assert kernel_calls, "attn was not called"
        assert all(c["attn_mask"] is None for c in kernel_calls)
        keys = sorted({c["key"][2] for c in kernel_calls})
        assert keys == sorted(set(lengths)), keys
        for c in kernel_calls:
            assert c["query"][0] == 1 and c["query"][2] == 12
        windows = {c["window_size"] for c in kernel_calls}
        if family in ("mistral", "gemma2"):
            assert (4, 0) in windows  # transformers' sliding_window 5 = the key itself and 4 before
        causal = {c["is_causal"] for c in kernel_calls}
        assert causal == ({False} if family == "bert" else {True})


def test_padding_with_holes_gets_the_dense_mask(kernel_calls):
    """A padding that is not one block per sequence is applied as transformers'
    boolean mask, and the logits still match sdpa."""
    ids, mask = batch(lengths=(12, 12))
    mask[1, 3:5] = 0
    with torch.no_grad():
        got = outputs(build("llama", "attn"), ids, mask)
        want = outputs(build("llama", "sdpa"), ids, mask)
    assert all(c["attn_mask"] is not None and c["attn_mask"].dtype == torch.bool for c in kernel_calls)
    assert_close(got, want, mask, F32_BOUND, "llama with holes vs sdpa")


def test_mask_rules_against_transformers_masks():
    """MaskRules (offsets, windows, padding) turned into attn's rules and key
    ranges give the attention of transformers' own boolean masks, computed by
    torch's SDPA, on every row that sees a key."""
    from transformers import masking_utils as mu

    g = torch.Generator().manual_seed(5)
    B, H, Hkv, E = 3, 4, 2, 8
    module = torch.nn.Module()
    module.is_causal = True
    for L, S, q_off, kv_off, fn in [
        (6, 6, 0, 0, mu.causal_mask_function),
        (3, 10, 7, 0, mu.causal_mask_function),
        (6, 6, 0, 0, mu.bidirectional_mask_function),
        (7, 7, 0, 0, mu.sliding_window_causal_mask_function(3)),
        (1, 6, 9, 4, mu.sliding_window_causal_mask_function(6)),
        (4, 9, 5, 0, mu.sliding_window_causal_mask_function(4)),
        (6, 6, 0, 0, mu.sliding_window_bidirectional_mask_function(2)),
    ]:
        mixed = torch.ones(B, kv_off + S, dtype=torch.bool)
        mixed[1, kv_off + S - 2:] = False  # right padding
        mixed[2, :kv_off + 3] = False  # left padding
        same = torch.ones(B, kv_off + S, dtype=torch.bool)
        same[:, kv_off + S - 1:] = False  # every row: the last key is not real (a static cache's tail)
        for pad in (mixed, same, None):
            q = torch.randn(B, H, L, E, generator=g)
            k, v = torch.randn(B, Hkv, S, E, generator=g), torch.randn(B, Hkv, S, E, generator=g)
            args = dict(batch_size=B, q_length=L, kv_length=S, q_offset=q_off, kv_offset=kv_off, mask_function=fn,
                        attention_mask=pad)
            rules = attn.hf.mask_rules(**args)
            assert isinstance(rules, attn.hf.MaskRules)
            got, _ = attn.hf.attention_forward(module, q, k, v, rules)
            dense = mu.sdpa_mask(allow_is_causal_skip=False, **args)
            dense = torch.ones(B, 1, L, S, dtype=torch.bool) if dense is None else dense
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
            sees = dense.any(dim=-1)[:, 0]  # (B, L)
            err = (got.transpose(1, 2) - want).abs().amax(dim=(1, 3))[sees]
            assert float(err.max()) <= 1e-5, (L, S, q_off, kv_off, float(err.max()))
            assert float(got.transpose(1, 2)[~sees[:, None, :].expand(B, H, L)].abs().sum()) == 0.0


def test_attention_dropout_in_training_mode():
    """A model whose config has attention dropout trains through attn's
    dropout: reproducible under torch.manual_seed, different from eval mode,
    and its gradients finite."""
    model = build("llama", "attn")
    ids, mask = batch()
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.eval()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
    model.train()
    torch.manual_seed(3)
    a = model(input_ids=ids, attention_mask=mask).logits
    torch.manual_seed(3)
    b = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a, b)
    assert not torch.allclose(a, plain)
    a.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_refusals():
    model = build("llama", "attn")
    ids, mask = batch()
    with pytest.raises(ValueError, match="output_attentions"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, output_attentions=True)
    with pytest.raises(ValueError, match="AttnCache needs the model's attention implementation to be attn's"):
        attn.hf.AttnCache(build("llama", "sdpa").config)


# -- attn's cache inside generate() --------------------------------------------


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt_oss", "gpt2"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_attn_cache_generation(family, layout):
    """generate() with AttnCache (float32 storage) gives the tokens of
    transformers' DynamicCache, over left-padded prompts and past the
    sliding window; the cache grows past its first capacity."""
    ids, mask = batch(seed=6, left=True)
    model = build(family, "attn")
    page = 4 if layout == "paged" else 0
    with torch.no_grad():
        want, logits = greedy(model, ids, mask, 12)
        cache = attn.hf.AttnCache(model.config, page_size=page)
        for layer in cache.layers:  # start small, so that generation grows it
            layer.max_cache_len = None
        got, _ = greedy(model, ids, mask, 12, cache=cache)
    assert_same_tokens(got, want, logits, F32_BOUND, f"{family} AttnCache vs DynamicCache")
    assert cache.get_seq_length() == ids.shape[1] + 12 - 1


def teacher_forced_logits(model, ids, mask, follow, cache):
    """Last-position logits (B, 1 + n, V) of the prompt and then of each token
    of `follow` (B, n) fed one at a time through `cache`."""
    logits = [model(input_ids=ids, attention_mask=mask, cache=cache).logits[:, -1]]
    for i in range(follow.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits.append(model(input_ids=follow[:, i:i + 1], attention_mask=mask, cache=cache).logits[:, -1])
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("storage", ["bfloat16", "float16"])
def test_attn_cache_half_storage(storage):
    """Half-precision storage against the float32 cache. Rounding the stored
    keys and values (relative eps/2 of the storage) moves each attention
    output by about eps·(1 + max |score|) relative; through Nl layers the
    logits move by at most 2·Nl·eps_storage relative to their largest (the
    tiny model's scores are of order 1): checked on 12 decoding steps of a
    fixed continuation, then greedy tokens must be identical while the float32
    cache's margin exceeds twice that. The memory is half of the float32
    cache's, and what the layout implies."""
    bound = 2 * LAYERS * torch.finfo(getattr(torch, storage)).eps
    ids, mask = batch(seed=7, left=True)
    follow = torch.randint(1, VOCAB, (ids.shape[0], 12), generator=torch.Generator().manual_seed(9))
    model = build("llama", "attn")
    with torch.no_grad():
        full = attn.hf.AttnCache(model.config, max_cache_len=64)
        half = attn.hf.AttnCache(model.config, dtype=storage, max_cache_len=64)
        want = teacher_forced_logits(model, ids, mask, follow, full)
        got = teacher_forced_logits(model, ids, mask, follow, half)
        err, scale = float((got - want).abs().max()), float(want.abs().max())
        assert err <= bound * max(1.0, scale), f"{storage} cache: logits error {err:.3g} > {bound * scale:.3g}"
        assert err > 0  # the storage did round
        want_tokens, logits = greedy(model, ids, mask, 12, cache=attn.hf.AttnCache(model.config))
        got_tokens, _ = greedy(model, ids, mask, 12, cache=attn.hf.AttnCache(model.config, dtype=storage))
    assert_same_tokens(got_tokens, want_tokens, logits, bound, f"{storage} cache vs float32 cache")
    B, Hkv = ids.shape[0], 2
    assert full.storage_bytes == LAYERS * 2 * B * Hkv * 64 * HEAD_DIM * 4
    assert half.storage_bytes * 2 == full.storage_bytes


def test_attn_cache_with_a_bfloat16_model():
    """A bfloat16 model: the cache stores what it is given (here bfloat16
    keys and values, exactly), attention runs in float32 and returns
    bfloat16; tokens as with transformers' cache, within the bfloat16 bound."""
    ids, mask = batch(seed=8, left=True)
    model = build("llama", "attn", torch.bfloat16)
    with torch.no_grad():
        want, logits = greedy(model, ids, mask, 10)
        cache = attn.hf.AttnCache(model.config, dtype="bfloat16")
        got, _ = greedy(model, ids, mask, 10, cache=cache)
    assert cache.get_seq_length() == ids.shape[1] + 9
    assert_same_tokens(got, want, logits, BF16_BOUND, "bfloat16 model, AttnCache vs DynamicCache")


@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
def test_attn_cache_step_equals_append_then_decode(storage):
    """A layer's decoding steps through AttnCacheLayer (update() keeps the
    new tokens, the attention appends them and attends in one call) give the
    bits of appending to an attn.KVCache and calling attn.decode_attention.
    The layer counts a pending step's tokens; whatever reads the cache before
    the attention runs (crop) appends them first; a refused attention names
    the argument and leaves the cache and the pending tokens as they were."""
    g = torch.Generator().manual_seed(11)
    B, H, Hkv, E = 2, 6, 2, 16
    module = torch.nn.Module()
    module.is_causal = True
    layer = attn.hf.AttnCacheLayer(dtype=storage, max_cache_len=40)
    ref = attn.KVCache(B, Hkv, 40, E, dtype=storage)
    with torch.no_grad():
        k0, v0 = torch.randn(B, Hkv, 9, E, generator=g), torch.randn(B, Hkv, 9, E, generator=g)
        layer.update(k0, v0)
        ref.append(k0, v0)
        for held in range(10, 16):
            # the model's layouts: (B, n, heads, E) projections seen as (B, heads, n, E)
            q = torch.randn(B, 1, H, E, generator=g).transpose(1, 2)
            k, v = (torch.randn(B, 1, Hkv, E, generator=g).transpose(1, 2) for _ in range(2))
            keys, values = layer.update(k, v)
            assert layer.get_seq_length() == held
            rules = attn.hf.MaskRules(batch=B, q_length=1, kv_length=held, q_offset=held - 1, kv_offset=0,
                                      causal=True, window=None, padding=None)
            got, _ = attn.hf.attention_forward(module, q, keys, values, rules, scaling=0.3)
            ref.append(k, v)
            want = attn.decode_attention(q, ref, scale=0.3, is_causal=True)
            assert got.shape == (B, 1, H, E) and got.is_contiguous()
            assert torch.equal(got, want.transpose(1, 2))
        keys, values = layer.update(k, v)
        with pytest.raises(ValueError, match="argument 'q' has shape"):
            attn.hf.attention_forward(module, torch.zeros(B, H, 1, E + 1), keys, values, None)
        assert layer.get_seq_length() == 16 and layer.kv.lengths == (15, 15)
        with torch.enable_grad(), pytest.raises(ValueError, match="'query' requires grad"):
            attn.hf.attention_forward(module, q.clone().requires_grad_(), keys, values, None)
        layer.crop(-1)  # appends the pending token, then drops it
        assert layer.get_seq_length() == 15 and layer.kv.lengths == (15, 15)
        keys, values = layer.update(k, v)
        layer.update(k, v)  # the second update appends the first's tokens
        assert layer.get_seq_length() == 17 and layer.kv.lengths == (16, 16)
        ref.append(k, v)
        ref.append(k, v)
        attn.hf.attention_forward(module, q, keys, values, None)
    for b in range(B):
        for x, y in zip(layer.kv.read(b), ref.read(b)):
            assert np.array_equal(x, y)
