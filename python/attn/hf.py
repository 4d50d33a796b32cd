"""attn inside Hugging Face transformers models: an attention implementation
and a KV cache for generate().

    import attn.hf
    attn.hf.register()                       # once: makes "attn" a valid implementation
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attn")
    model.set_attn_implementation("attn")    # or switch a loaded model
    out = model.generate(**inputs, cache=attn.hf.AttnCache(model.config, dtype="bfloat16"))

register() adds two functions to transformers' registries:

- the attention function (AttentionInterface) maps transformers' arguments
  onto attn.torch.scaled_dot_product_attention: query (B, H, L, E) and
  key/value (B, Hkv, S, E) are read in place (grouped heads go to attn's
  grouped path, no repeat_kv), `scaling` is the scale, `softcap` the soft-cap
  (Gemma 2), `s_aux` the sinks (gpt-oss, with gradient), `dropout` the
  dropout probability; it returns (output (B, L, H, Ev), None) as
  transformers' SDPA does;
- the mask function (AttentionMaskInterface) returns, for the masks whose
  structure it recognises (causal, bidirectional, sliding windows, padding),
  a MaskRules object instead of a (B, 1, L, S) tensor: the attention function
  turns it into attn's own rules (is_causal, window_size, position_offset) and
  per-sequence key ranges, so no O(L·S) mask is built for causal,
  sliding-window or padded batches whose padding is one block per sequence
  (right or left). Other patterns (packed sequences, custom overlays) get
  transformers' own boolean mask, which attn applies as it is.

AttnCache is a transformers Cache whose layers keep their keys and values in
an attn.KVCache (float32, float16 or bfloat16 storage, contiguous or paged):
with it, each generation step appends the new token's keys and values once
and attends over the history with attn.decode_attention, instead of
concatenating the history into new tensors every step.

Dropout: a model in training mode whose config has attention dropout gets
attn's dropout (each call draws its seed from torch's generator, so
torch.manual_seed makes a step reproducible; the backward drops the same
weights). AttnCache (inference) refuses a non-zero dropout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Tuple

try:
    import torch as _torch
    from transformers import AttentionInterface as _AttentionInterface
    from transformers import masking_utils as _masking
    from transformers.cache_utils import Cache as _Cache
    from transformers.cache_utils import CacheLayerMixin as _CacheLayerMixin
except ImportError as e:  # pragma: no cover - exercised only without them
    raise ImportError("attn.hf needs PyTorch and transformers (pip install torch transformers)") from e

import numpy as _np

from . import _attn, _decode
from . import torch as _attn_torch

__all__ = ["register", "attention_forward", "mask_rules", "MaskRules", "AttnCache", "AttnCacheLayer"]

NAME = "attn"
_REGISTERED = set()  # the names register() gave attn's functions
_FN = "attn.hf"


# --------------------------------------------------------------------------
# The mask: transformers' mask description, kept as rules.


@dataclass
class MaskRules:
    """What transformers' mask function was asked for, without the (B, 1, L, S)
    tensor: query row i sits at absolute position q_offset + i, key column j at
    kv_offset + j.

      causal    key position <= query position
      window    transformers' sliding_window w: causal keys with
                key > query - w; bidirectional keys with |query - key| <= w
      padding   (B, S) bool, True = the key is a real token (None: no padding)
    """

    batch: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    causal: bool
    window: Optional[int]
    padding: Optional[Any]

    @property
    def position_offset(self) -> int:
        """attn's position_offset: query row i sits at key column i + offset."""
        return self.q_offset - self.kv_offset

    def window_size(self) -> Optional[Tuple[int, int]]:
        """attn's window_size (left, right), or None (no window)."""
        if self.window is None:
            return None
        return (self.window - 1, 0) if self.causal else (self.window, self.window)


def _closure(fn: Any, name: str) -> Any:
    """The value of free variable `name` of function fn, or None."""
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None or name not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def _pattern(mask_function: Any) -> Optional[Tuple[bool, Optional[int]]]:
    """(causal, window) of the mask functions transformers builds for plain
    causal, bidirectional and sliding-window attention; None for any other."""
    if mask_function is _masking.causal_mask_function:
        return True, None
    if mask_function is _masking.bidirectional_mask_function:
        return False, None
    parts = _closure(mask_function, "mask_functions")  # and_masks(overlay, base)
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    overlay, base = parts
    window = _closure(overlay, "sliding_window")
    if not isinstance(window, int) or isinstance(window, bool):
        return None
    name = getattr(overlay, "__qualname__", "")
    if base is _masking.causal_mask_function and name.startswith("sliding_window_overlay."):
        return True, window
    if base is _masking.bidirectional_mask_function and name.startswith("sliding_window_bidirectional_overlay."):
        return False, window
    return None


def mask_rules(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
               mask_function: Any = None, attention_mask: Any = None, use_vmap: bool = False, **kwargs):
    """transformers' mask function for the "attn" implementation (registered
    with AttentionMaskInterface; the arguments are sdpa_mask's). Returns
    MaskRules for the patterns it recognises, transformers' boolean mask
    (or None) otherwise."""
    if mask_function is None:
        mask_function = _masking.causal_mask_function
    pattern = None if use_vmap else _pattern(mask_function)
    if pattern is None:
        return _masking.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                                  kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                                  use_vmap=use_vmap, **kwargs)
    padding = _masking.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding[:, kv_offset:kv_offset + kv_length].to(_torch.bool)
        if bool(padding.all()):
            padding = None
    causal, window = pattern
    return MaskRules(batch=int(batch_size), q_length=int(q_length), kv_length=int(kv_length),
                     q_offset=int(q_offset), kv_offset=int(kv_offset), causal=causal, window=window,
                     padding=padding)


def _key_ranges(padding: Any) -> Optional[Any]:
    """(B, 2) [first, end) of each row's real keys when every row's real keys
    form one block (right or left padding); None when a row has holes."""
    n = padding.shape[-1]
    count = padding.sum(dim=-1)
    first = _torch.where(count > 0, padding.to(_torch.int8).argmax(dim=-1), _torch.zeros_like(count))
    cols = _torch.arange(n, device=padding.device)
    block = (cols >= first[:, None]) & (cols < (first + count)[:, None])
    if not bool(_torch.equal(block, padding)):
        return None
    return _torch.stack([first, first + count], dim=-1)


# --------------------------------------------------------------------------
# The attention function.


def _call(query, key, value, *, attn_mask=None, dropout=0.0, is_causal=False, scale=None, window_size=None,
          softcap=None, sinks=None, position_offset=None):
    """One attn call on transformers' layouts: query (B, H, L, E), key/value
    (B, Hkv, S, E); returns (B, H, L, Ev)."""
    gqa = query.shape[-3] != key.shape[-3]
    return _attn_torch.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout, is_causal=is_causal, scale=scale,
        enable_gqa=gqa, window_size=window_size, softcap=softcap, sinks=sinks, position_offset=position_offset)


def _with_rules(query, key, value, rules: MaskRules, **kw):
    """attention under MaskRules: causal, window and offset as attn's rules;
    padding as per-sequence key ranges (key slices, no copy); a padding
    with holes as transformers' boolean mask."""
    L, S = query.shape[-2], key.shape[-2]
    if (L, S) != (rules.q_length, rules.kv_length):
        raise ValueError(f"{_FN}: the mask was built for {rules.q_length} queries over {rules.kv_length} keys, "
                         f"but the attention got query {tuple(query.shape)} and key {tuple(key.shape)}")
    rule = dict(is_causal=rules.causal, window_size=rules.window_size())
    if rules.padding is None:
        return _call(query, key, value, position_offset=rules.position_offset, **rule, **kw)
    ranges = _key_ranges(rules.padding)
    if ranges is None:
        mask = _dense(rules)
        return _call(query, key, value, attn_mask=mask, **kw)
    if bool((ranges == ranges[0]).all()) and ranges[0, 1] > ranges[0, 0]:  # one range for all: one call
        lo, hi = ranges[0].tolist()
        return _call(query, key[:, :, lo:hi], value[:, :, lo:hi], position_offset=rules.position_offset - lo,
                     **rule, **kw)
    outs = []
    for b, (lo, hi) in enumerate(ranges.tolist()):
        q = query[b:b + 1]
        if hi == lo:  # no real key: attn's rule for a row that sees nothing
            outs.append(q.new_zeros(q.shape[:-1] + value.shape[-1:]))
            continue
        outs.append(_call(q, key[b:b + 1, :, lo:hi], value[b:b + 1, :, lo:hi],
                          position_offset=rules.position_offset - lo, **rule, **kw))
    return _torch.cat(outs, dim=0)


def _dense(rules: MaskRules) -> Any:
    """transformers' boolean (B, 1, L, S) mask for these rules (padding with holes)."""
    if rules.window is None:
        fn = _masking.causal_mask_function if rules.causal else _masking.bidirectional_mask_function
    elif rules.causal:
        fn = _masking.sliding_window_causal_mask_function(rules.window)
    else:
        fn = _masking.sliding_window_bidirectional_mask_function(rules.window)
    pad = _torch.ones(rules.batch, rules.kv_offset + rules.kv_length, dtype=_torch.bool,
                      device=rules.padding.device)
    pad[:, rules.kv_offset:] = rules.padding
    return _masking.sdpa_mask(batch_size=rules.batch, q_length=rules.q_length, kv_length=rules.kv_length,
                              q_offset=rules.q_offset, kv_offset=rules.kv_offset, mask_function=fn,
                              attention_mask=pad, allow_is_causal_skip=False, device=rules.padding.device)


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None, s_aux: Any = None,
                      **kwargs) -> Tuple[Any, None]:
    """transformers' attention function for the "attn" implementation (the
    signature of sdpa_attention_forward, plus sliding_window, softcap and
    s_aux): returns (output (B, L, H, Ev), None)."""
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"{_FN}: 'position_bias' (a learned additive bias, T5-style) is not supported; "
                         "use attn_implementation='eager' for this model")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{_FN}: 'output_attentions' is not supported (attn does not form the attention "
                         "weights); use attn_implementation='eager' to get them")
    layer = getattr(key, "_attn_cache_layer", None)
    if layer is not None:  # a decoding step over AttnCache: (B, L, H, Ev) already
        return layer.attend(query, attention_mask, module=module, is_causal=is_causal, sliding_window=sliding_window,
                            dropout=dropout, scale=scaling, softcap=softcap, sinks=s_aux), None
    kw = dict(dropout=float(dropout or 0.0), scale=scaling, softcap=softcap or None, sinks=s_aux)
    L = query.shape[-2]
    if isinstance(attention_mask, MaskRules):
        out = _with_rules(query, key, value, attention_mask, **kw)
    elif attention_mask is not None:
        out = _call(query, key, value, attn_mask=attention_mask, **kw)
    else:
        out = _call(query, key, value, is_causal=_sdpa_causal(module, is_causal, L), **kw)
    return out.transpose(1, 2).contiguous(), None


def _sdpa_causal(module: Any, is_causal: Optional[bool], L: int) -> bool:
    """SDPA's rule when no mask is given: causal for more than one query of a causal module."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return bool(L > 1 and causal)


def _float32_view(t: Any, name: str) -> Any:
    """A tensor as float32 NumPy for the per-step call: a float32 CPU
    tensor's own memory through Tensor.numpy() (no copy, and a fraction of
    DLPack's cost per call); other float dtypes are widened first (a copy);
    what numpy() refuses (another device, a lazy negation) goes through the
    checked conversion, whose errors name the argument."""
    if t.dtype != _torch.float32:
        t = t.float()
    try:
        return t.detach().numpy() if t.requires_grad else t.numpy()
    except (RuntimeError, TypeError):
        return _decode._f32(t, _FN, name, t.dim())


# --------------------------------------------------------------------------
# The cache.


class AttnCacheLayer(_CacheLayerMixin):
    """One layer's keys and values in an attn.KVCache.

    update() takes the new tokens. When the layer held nothing before (the
    prompt), it appends them and returns the new keys and values themselves,
    and attention runs on them as usual. Afterwards it keeps them pending and
    returns them marked with this layer; the attention function then appends
    them and attends over the whole stored history in one call of
    attn.decode_attention (attend()). Whatever reads the cache first (another
    update, crop, reorder) appends pending tokens. Inference only:
    decode_attention has no backward."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, dtype: str = "float32", page_size: int = 0, max_cache_len: Optional[int] = None, **kwargs):
        super().__init__()
        self.storage = str(dtype)
        self.page_size = int(page_size)
        self.max_cache_len = None if max_cache_len is None else int(max_cache_len)
        self.kv: Optional[_decode.KVCache] = None
        self._pending: Optional[Tuple[Any, Any]] = None  # keys and values update() took, not yet appended

    def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        B, Hkv, n, E = key_states.shape
        capacity = self.max_cache_len or max(256, 2 * n)
        self.kv = self._new(B, Hkv, capacity, E, value_states.shape[-1])
        self.is_initialized = True

    def _new(self, B: int, Hkv: int, capacity: int, E: int, Ev: int) -> _decode.KVCache:
        return _decode.KVCache(B, Hkv, capacity, E, value_dim=Ev, dtype=self.storage, page_size=self.page_size)

    def _flush(self) -> None:
        """Appends the pending tokens (a step whose attention has not run)."""
        if self._pending is not None:
            k, v = self._pending
            self._pending = None
            self.kv.append(k.detach().float(), v.detach().float())

    def _rebuild(self, rows: list, capacity: int) -> None:
        """A new KVCache whose sequence b holds the tokens of old sequence rows[b]."""
        self._flush()
        old = self.kv
        new = self._new(len(rows), old.kv_heads, capacity, old.head_dim, old.value_dim)
        for b, src in enumerate(rows):
            k, v = old.read(src)
            if k.shape[1]:
                new.append(k, v, seq=b)
        self.kv = new

    def update(self, key_states: Any, value_states: Any, *args, **kwargs) -> Tuple[Any, Any]:
        if key_states.requires_grad and _torch.is_grad_enabled():
            raise ValueError(f"{_FN}: AttnCache is for inference (attn.decode_attention has no backward); run "
                             "generation under torch.no_grad(), or train without a cache")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._flush()
        B, n = key_states.shape[0], key_states.shape[-2]
        if B != self.kv.batch:
            raise ValueError(f"{_FN}: the cache holds {self.kv.batch} sequences, the new keys have batch {B}")
        held = self.kv._c.length(0)
        if held + n > self.kv.capacity:
            if self.max_cache_len is not None:
                raise ValueError(f"{_FN}: {held} + {n} tokens exceed max_cache_len={self.max_cache_len}")
            self._rebuild(list(range(B)), max(2 * self.kv.capacity, held + n))
        if held == 0:
            self.kv.append(key_states.detach().float(), value_states.detach().float())
            return key_states, value_states
        # attend() appends them, in the call that attends (the library checks their shapes).
        self._pending = (key_states, value_states)
        k = key_states.detach()
        k._attn_cache_layer = self
        return k, value_states

    def attend(self, query: Any, mask: Any, *, module: Any, is_causal: Optional[bool], sliding_window: Optional[int],
               dropout: float, scale: Optional[float], softcap: Optional[float], sinks: Any) -> Any:
        """The new queries (B, H, L, E), the last L tokens, over everything
        stored and the pending tokens: output (B, L, H, Ev)."""
        if dropout:
            raise ValueError(f"{_FN}: 'dropout' is {dropout}; attention over AttnCache has no dropout "
                             "(use model.eval() for generation)")
        if _torch.is_grad_enabled():  # the views below would drop a graph silently
            _decode.refuse_grad(_FN, query=query, s_aux=sinks)
        pending = self._pending
        held = self.kv._c.length(0) + (0 if pending is None else pending[0].shape[-2])
        capacity = self.kv.capacity
        # No mask: SDPA's causal rule and the module's window, on the causal side.
        causal = _sdpa_causal(module, is_causal, query.shape[-2])
        window_size = None if sliding_window is None else (sliding_window - 1, 0)
        attn_mask = None
        if isinstance(mask, MaskRules):
            if (mask.kv_offset, mask.kv_length) != (0, held):
                raise ValueError(f"{_FN}: the mask covers keys {mask.kv_offset}..{mask.kv_offset + mask.kv_length} "
                                 f"but the cache holds {held} tokens")
            causal, window_size = mask.causal, mask.window_size()
            if mask.padding is not None:
                # One row of real-key flags per sequence, broadcast over heads and queries: O(B·S).
                attn_mask = _torch.zeros(mask.batch, 1, 1, capacity, dtype=_torch.bool)
                attn_mask[:, 0, 0, :mask.kv_length] = mask.padding.cpu()
        elif mask is not None:
            # transformers' own (B, 1, L, S) mask over the held keys, padded to the capacity.
            m = mask if mask.dtype == _torch.bool else mask.float()
            fill = False if m.dtype == _torch.bool else float("-inf")
            attn_mask = m.new_full(m.shape[:-1] + (capacity,), fill)
            attn_mask[..., :m.shape[-1]] = m
            causal, window_size = False, None  # the mask holds every rule
        q = _float32_view(query, "query")
        B, H, L = q.shape[:3]
        left, right = (-1, -1) if window_size is None else window_size
        masks = {} if attn_mask is None else _decode.mask_operand(attn_mask, _FN, q.shape, capacity)
        k = v = None
        if pending is not None:
            k, v = _float32_view(pending[0], "key"), _float32_view(pending[1], "value")
        out = _np.empty((B, L, H, self.kv.value_dim), _np.float32)
        _attn.decode_attention(q, self.kv._c, out.transpose(0, 2, 1, 3), None, scale, causal, "auto", 0, left, right,
                               float(softcap or 0.0), 0, None, None if sinks is None else _float32_view(sinks, "s_aux"),
                               masks.get("mask"), masks.get("bias"), k, v)
        self._pending = None
        o = _torch.from_numpy(out)
        return o if query.dtype == _torch.float32 else o.to(query.dtype)

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        if self.kv is None:
            return 0
        return self.kv._c.length(0) + (0 if self._pending is None else self._pending[0].shape[-2])

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    @property
    def batch_size(self) -> int:
        return -1 if self.kv is None else self.kv.batch

    @property
    def storage_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.storage_bytes

    def reset(self) -> None:
        self._pending = None
        if self.kv is not None:
            self.kv.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens (transformers' negative convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"{_FN}: crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        self._flush()
        keep = max(self.get_seq_length() + tokens_to_remove, 0)
        if self.kv is not None and tokens_to_remove:
            for b in range(self.kv.batch):
                self.kv.truncate(b, keep)

    def reorder_cache(self, beam_idx: Any) -> None:
        if self.kv is not None:
            self._rebuild([int(i) for i in beam_idx.tolist()], self.kv.capacity)

    def batch_select_indices(self, indices: Any) -> None:
        self.reorder_cache(_torch.as_tensor(indices).reshape(-1))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.kv is not None:
            self._rebuild([b for b in range(self.kv.batch) for _ in range(repeats)], self.kv.capacity)


class AttnCache(_Cache):
    """A transformers Cache backed by attn.KVCache, one per layer, for the
    "attn" attention implementation.

    AttnCache(config, dtype="float32", page_size=0, max_cache_len=None)

    dtype: the storage of keys and values ("float32", "float16", "bfloat16"),
    rounded to nearest even on append; attention is computed in float32 on
    the stored values. page_size > 0 stores them in pages. max_cache_len fixes
    the capacity (default: grows by doubling, copying the history once per
    doubling). Sliding-window layers keep every token and attend to their
    window. storage_bytes reports the memory of all layers. Without a config,
    layers are added as the model first reaches them, and the attention
    implementation is not checked."""

    def __init__(self, config: Any = None, *, dtype: str = "float32", page_size: int = 0,
                 max_cache_len: Optional[int] = None):
        make = functools.partial(AttnCacheLayer, dtype=dtype, page_size=page_size, max_cache_len=max_cache_len)
        if config is None:
            super().__init__(layer_class_to_replicate=make)
            return
        text = config.get_text_config(decoder=True)
        impl = getattr(config, "_attn_implementation", None)
        if impl is not None and impl not in _REGISTERED:
            raise ValueError(f"{_FN}: AttnCache needs the model's attention implementation to be attn's "
                             f"(attn.hf.register(), then attn_implementation='{NAME}'); this config has '{impl}'")
        super().__init__(layers=[make() for _ in range(text.num_hidden_layers)])

    @property
    def storage_bytes(self) -> int:
        """Bytes of key and value storage over all layers."""
        return sum(layer.storage_bytes for layer in self.layers)


# --------------------------------------------------------------------------


def register(name: str = NAME) -> str:
    """Register the attention and mask functions under `name` (default "attn")
    with transformers' AttentionInterface and AttentionMaskInterface, so that
    from_pretrained(..., attn_implementation=name) and
    model.set_attn_implementation(name) use attn. Returns the name."""
    _AttentionInterface.register(name, attention_forward)
    _masking.AttentionMaskInterface.register(name, mask_rules)
    _REGISTERED.add(name)
    return name
