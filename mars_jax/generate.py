r"""Generation CLI: complete prompts with a trained run's latest checkpoint.

  python -m mars_jax.generate --workdir=runs/mars --prompt="What is 12 * 7?" \
      --threshold=0.95 [--block_size=4 --max_new_tokens=256 --json]

Each prompt is a user turn rendered with the run's chat template. Prints the completion, or
with --json one JSON object per prompt: {"prompt", "tokens" (ids), "text",
"tokens_per_forward"}. ``--prompt`` may be repeated; the prompts are decoded as one batch.
"""

from __future__ import annotations

import json

from absl import app, flags

from mars_jax import decode, workdir as wd

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.", required=True)
_PROMPT = flags.DEFINE_multi_string("prompt", None, "User message(s).", required=True)
_THRESHOLD = flags.DEFINE_float("threshold", 0.95, "Confidence threshold; 1.0 = AR decoding.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", None, "Block size (default: the run's).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Completion budget per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_SYSTEM = flags.DEFINE_string("system", None, "Optional system message.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object per prompt.")


def main(argv):
    del argv
    wd.quiet_library_logs()
    model, tok, _ = wd.load_model(_WORKDIR.value, step=_STEP.value)
    system = [{"role": "system", "content": _SYSTEM.value}] if _SYSTEM.value else []
    prompts = [
        tok.apply_chat_template(
            system + [{"role": "user", "content": p}], add_generation_prompt=True
        )
        for p in _PROMPT.value
    ]
    out = decode.generate(
        model,
        *decode.pad_prompts(prompts, tok.pad_id),
        block_size=(
            wd.trained_block_size(_WORKDIR.value)
            if _BLOCK_SIZE.value is None
            else _BLOCK_SIZE.value
        ),
        threshold=_THRESHOLD.value,
        max_new_tokens=_MAX_NEW.value,
        temperature=_TEMPERATURE.value,
        mask_id=tok.mask_id,
    )
    for i, prompt in enumerate(_PROMPT.value):
        tokens = out.tokens[i, : out.lengths[i]].tolist()
        text = tok.decode(tokens)
        if _JSON.value:
            tpf = out.accepted[i] / max(out.row_forwards[i], 1)
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "tokens": tokens,
                        "text": text,
                        "tokens_per_forward": float(tpf),
                    }
                )
            )
        else:
            print(text)


if __name__ == "__main__":
    app.run(main)
