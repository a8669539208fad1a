r"""Generation: complete prompts with a trained run's checkpoint.

  python -m mars_jax.generate --workdir=runs/mars --prompt="What is 12 * 7?" \
      --threshold=0.95 [--block_size=4 --max_new_tokens=256 --json]

From Python: ``generate.complete(workdir, ["What is 12 * 7?"], threshold=0.95)``.

Each prompt is a user turn rendered with the run's chat template. The CLI prints the completion,
or with --json one JSON object per prompt: {"prompt", "tokens" (ids), "text",
"tokens_per_forward"}. ``--prompt`` may be repeated; the prompts are decoded as one batch.
"""

from __future__ import annotations

import json
from typing import Sequence

from absl import flags

from mars_jax import cli, decode, workdir as wd


def complete(
    workdir: str,
    prompts: Sequence[str],
    *,
    threshold: float = 0.95,
    block_size: int | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    system: str | None = None,
    step: int | None = None,
) -> list[dict]:
    """Decodes ``prompts`` (user messages) as one batch with checkpoint ``step`` (default: the
    latest) of the run in ``workdir``.

    ``block_size`` defaults to the run's; ``system`` is an optional system message; the other
    arguments are as in `decode.generate`. Returns one dict per prompt: {"prompt" (str),
    "tokens" (completion ids, EOS excluded), "text", "tokens_per_forward" (float)}.
    Raises FileNotFoundError for a directory that is not a run with a checkpoint, ValueError as
    `decode.generate`.
    """
    model, tok, _ = wd.load_model(workdir, step=step)
    system_turn = [{"role": "system", "content": system}] if system else []
    ids = [
        tok.apply_chat_template(
            system_turn + [{"role": "user", "content": p}], add_generation_prompt=True
        )
        for p in prompts
    ]
    out = decode.generate(
        model,
        *decode.pad_prompts(ids, tok.pad_id),
        block_size=wd.trained_block_size(workdir) if block_size is None else block_size,
        threshold=threshold,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        mask_id=tok.mask_id,
    )
    return [
        {
            "prompt": prompt,
            "tokens": tokens,
            "text": tok.decode(tokens),
            "tokens_per_forward": float(tpf),
        }
        for prompt, tokens, tpf in zip(prompts, out.completions(), out.row_tokens_per_forward)
    ]


def main() -> None:
    """``python -m mars_jax.generate --workdir=DIR --prompt=TEXT [--prompt=TEXT ...]``."""
    workdir = cli.workdir_flag()
    prompt = flags.DEFINE_multi_string("prompt", None, "User message(s).", required=True)
    threshold = flags.DEFINE_float("threshold", 0.95, "Confidence threshold; 1.0 = AR decoding.")
    block_size = flags.DEFINE_integer("block_size", None, "Block size (default: the run's).")
    max_new = flags.DEFINE_integer("max_new_tokens", 256, "Completion budget per prompt.")
    temperature = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
    system = flags.DEFINE_string("system", None, "Optional system message.")
    step = cli.step_flag()
    as_json = flags.DEFINE_bool("json", False, "Print one JSON object per prompt.")

    def run():
        for result in complete(
            workdir.value,
            prompt.value,
            threshold=threshold.value,
            block_size=block_size.value,
            max_new_tokens=max_new.value,
            temperature=temperature.value,
            system=system.value,
            step=step.value,
        ):
            print(json.dumps(result) if as_json.value else result["text"])

    cli.run(run)


if __name__ == "__main__":
    main()
