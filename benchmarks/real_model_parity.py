r"""Greedy parity on a real model: our decoder against transformers' greedy ``generate``.

  PYTHONPATH=. python benchmarks/real_model_parity.py --workdir=models/smollm2 \
      --max_new_tokens=128 --output=benchmarks/results/smollm2_parity.json

Decodes chat prompts one token per forward (block size 1, threshold 1.0) in fp32 and in bf16
compute (parameters in fp32), each up to its end of turn or the budget, and compares each with transformers' fp32 greedy tokens
of the same prompt decoded alone: the prompts equal token for token, and the mean fraction of
each completion before its first difference. fp32 should agree exactly (tests/project/test_real_model.py
asserts it); bf16 rounds every matmul, so where two tokens are nearly tied its greedy choice
flips, and everything after differs.
"""

from __future__ import annotations

import json

import numpy as np
from absl import app, flags

from mars_jax import decode, sources
from tools import smollm2

PROMPTS = list(smollm2.PARITY_PROMPTS)


def transformers_tokens(path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stop = model.generation_config.eos_token_id
    greedy = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=stop)
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                generation_config=greedy,
            )
            tokens = gen[0, len(ids) :].tolist()
            out.append(tokens[: tokens.index(stop)] if stop in tokens else tokens)
    return out


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    prefix = []
    for a, b in zip(ours, theirs):
        same = (
            len(b)
            if a == b
            else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        )
        prefix.append(same / len(b))
    return {
        "prompts_equal": float(np.mean([a == b for a, b in zip(ours, theirs)])),
        "mean_prefix_fraction": float(np.mean(prefix)),
    }


def parity(path: str, max_new_tokens: int) -> dict:
    report = {"workdir": path, "prompts": len(PROMPTS), "max_new_tokens": max_new_tokens}
    theirs = None
    for dtype in ("float32", "bfloat16"):
        opened = sources.open(path, block_size=1, dtype=dtype)
        tok = opened.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], True) for p in PROMPTS]
        if theirs is None:
            theirs = transformers_tokens(path, prompts, max_new_tokens)
        out = decode.generate_batched(
            opened.model,
            prompts,
            batch_size=len(prompts),
            block_size=1,
            threshold=1.0,
            max_new_tokens=max_new_tokens,
            **opened.decode_ids(),
        )
        report[dtype] = agreement(out.completions(), theirs)
    return report


_WORKDIR = flags.DEFINE_string("workdir", "models/smollm2", "a Hugging Face directory or run")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "tokens compared per prompt")
_OUTPUT = flags.DEFINE_string("output", "", "write the report (JSON) here too")


def main(argv):
    del argv
    report = parity(_WORKDIR.value, _NEW.value)
    print(json.dumps(report, indent=1))
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    app.run(main)
