r"""Export: write a run's checkpoint as a Hugging Face directory.

  python -m mars_jax.export --workdir=runs/mars --output=hf_out [--step=N --dtype=bfloat16]

From Python: ``export.export_run("runs/mars", "hf_out")``.

The directory (config.json, generation_config.json, safetensors weights, tokenizer files with
<|mask|> = 151665 as the mask token and the chat template) loads with
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer``, so a MARS model serves anywhere an
AR Qwen2.5 does (one-token mode needs no special decoder): generation_config.json makes
``generate`` greedy and stop at <|im_end|> or <|endoftext|>, as `mars_jax.decode` does.
config.json also records ``mask_token_id`` and ``mars_block_size`` (the block size the run was
trained with) for a MARS decoder.
"""

from __future__ import annotations

from absl import flags, logging

from mars_jax import cli, huggingface, workdir as wd


def export_run(
    workdir: str, output: str, *, step: int | None = None, dtype: str | None = None
) -> int:
    """Writes checkpoint ``step`` (default: the latest) of the run in ``workdir`` and its
    tokenizer to the Hugging Face directory ``output``; ``dtype`` (e.g. "bfloat16") casts the
    weights (default: the param dtype). config.json records the tokenizer's <|mask|> id and
    the run's training block size (`huggingface.export_hf`). Returns the exported step.

    Raises FileNotFoundError for a directory that is not a run with a checkpoint,
    FileExistsError when ``output`` already holds weights (see `huggingface.export_hf`).
    """
    model, tok, step = wd.load_model(workdir, step=step)
    huggingface.export_hf(
        model,
        output,
        dtype=dtype,
        mask_token_id=tok.mask_id,
        block_size=wd.trained_block_size(workdir),
    )
    tok.save(output)
    logging.info("exported %s step %d to %s", workdir, step, output)
    return step


def main() -> None:
    """``python -m mars_jax.export --workdir=DIR --output=DIR [--step=N] [--dtype=bfloat16]``."""
    workdir = cli.workdir_flag()
    output = flags.DEFINE_string("output", None, "Output directory.", required=True)
    step = cli.step_flag()
    dtype = flags.DEFINE_string("dtype", None, "Weight dtype to save (default: param dtype).")
    cli.run(lambda: export_run(workdir.value, output.value, step=step.value, dtype=dtype.value))


if __name__ == "__main__":
    main()
