r"""Export: write a run's checkpoint as a Hugging Face directory.

  python -m mars_jax.export --workdir=runs/mars --output=hf_out [--step=N --dtype=bfloat16]

From Python: ``export.export_run("runs/mars", "hf_out")``.

The directory (config.json, safetensors weights, tokenizer files with <|mask|> = 151665 and
the chat template) loads with ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer``, so a
MARS model serves anywhere an AR Qwen2.5 does (one-token mode needs no special decoder).
"""

from __future__ import annotations

from absl import flags, logging

from mars_jax import cli, huggingface, workdir as wd


def export_run(
    workdir: str, output: str, *, step: int | None = None, dtype: str | None = None
) -> int:
    """Writes checkpoint ``step`` (default: the latest) of the run in ``workdir`` and its
    tokenizer to the Hugging Face directory ``output``; ``dtype`` (e.g. "bfloat16") casts the
    weights (default: the param dtype). Returns the exported step.

    Raises FileNotFoundError for a directory that is not a run with a checkpoint,
    FileExistsError when ``output`` already holds weights (see `huggingface.export_hf`).
    """
    model, tok, step = wd.load_model(workdir, step=step)
    huggingface.export_hf(model, output, dtype=dtype)
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
