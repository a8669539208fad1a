r"""Export: write a run's checkpoint as a Hugging Face directory.

  python -m mars_jax.export --workdir=runs/mars --output=hf_out [--step=N --dtype=bfloat16 \
      --base_model=Qwen/Qwen2.5-0.5B-Instruct]

From Python: ``export.export_run("runs/mars", "hf_out")``.

The directory (config.json, generation_config.json, safetensors weights, tokenizer files with
the run's mask token and chat template) loads with ``transformers.AutoModelForCausalLM`` /
``AutoTokenizer``, so a MARS model serves anywhere its AR base model does (one-token mode needs
no special decoder): generation_config.json makes ``generate`` greedy and stop at the
tokenizer's stop ids, as `mars_jax.decode` does.
config.json also records ``mask_token_id`` and ``mars_block_size`` (the block size the run was
trained with) for a MARS decoder. README.md is a model card (`model_card`): block size, mask
token, recommended thresholds, the training objective, the run's latest evaluation and how to
decode with MARS.
"""

from __future__ import annotations

import json

from absl import flags, logging

from mars_jax import cli, huggingface, plots, storage
from mars_jax import workdir as wd
from mars_jax.errors import InputError
from mars_jax.tokenizer import Tokenizer


def export_run(
    workdir: str,
    output: str,
    *,
    step: int | None = None,
    dtype: str | None = None,
    base_model: str | None = None,
) -> int:
    """Writes checkpoint ``step`` (default: the latest) of the run in ``workdir``, its
    tokenizer and its model card README.md (`model_card`) to the Hugging Face directory
    ``output``; ``dtype`` (e.g. "bfloat16") casts the weights (default: the param dtype).
    config.json records the tokenizer's <|mask|> id and the run's training block size
    (`huggingface.export_hf`). ``base_model``, a Hugging Face Hub id such as
    "Qwen/Qwen2.5-0.5B-Instruct", goes into the card's metadata. Returns the exported step.

    Raises FileNotFoundError for a directory that is not a run with a checkpoint,
    FileExistsError when ``output`` already holds weights (see `huggingface.export_hf`),
    ValueError for a trimmed-vocabulary run (``data.trim_vocab``), before writing anything.
    """
    if (vocab_map := wd.read_vocab_map(workdir)) is not None:
        raise InputError(
            f"{workdir} has a trimmed vocabulary ({len(vocab_map)} rows, vocab_map.json): a "
            "Hugging Face checkpoint needs a row for every id, and without an output bias no "
            "weights keep the missing rows from being chosen; export is refused"
        )
    model, tok, step = wd.load_model(workdir, step=step)
    block_size = wd.trained_block_size(workdir)
    huggingface.export_hf(
        model,
        output,
        dtype=dtype,
        mask_token_id=tok.mask_id,
        block_size=block_size,
        special_ids=huggingface.token_ids(tok),
    )
    tok.save(output)
    eval_path = storage.join(workdir, "eval.json")
    report = None
    if storage.exists(eval_path):
        report = json.loads(storage.read_text(eval_path))
    card = model_card(
        wd.read_run_config(workdir),
        tok,
        workdir=workdir,
        step=step,
        block_size=block_size,
        eval_report=report,
        base_model=base_model,
        family=model.cfg.family,
    )
    storage.write_text(storage.join(output, "README.md"), card)
    logging.info("exported %s step %d to %s", workdir, step, output)
    return step


def model_card(
    run_config: dict,
    tok: Tokenizer,
    *,
    workdir: str,
    step: int,
    block_size: int,
    eval_report: dict | None = None,
    base_model: str | None = None,
    family: str = "qwen2",
) -> str:
    """The Hugging Face model card (README.md text) of checkpoint ``step`` of the run in
    ``workdir``: YAML metadata (``library_name: transformers``, ``base_model`` when given, tags
    mars and the model ``family``), then the training block size, the mask token and id of ``tok``, the
    objective (name, ``ar_weight``, normalization) and ``init_from`` of ``run_config`` (the
    run's config.json as a dict), the recommended thresholds, the table of ``eval_report`` (the
    run's eval.json, `plots.format_table`) when given, and how to decode with MARS
    (`mars_jax.decode`, `mars_jax.generate`) or as plain AR with transformers' ``generate``.
    Raises KeyError for a run config without the objective's keys.
    """
    objective = run_config["objective"]
    mask_token = tok.decode([tok.mask_id], skip_special_tokens=False)
    metadata = ["library_name: transformers"]
    if base_model:
        metadata.append(f"base_model: {json.dumps(base_model)}")
    metadata += ["tags:", "- mars", f"- {family}"]
    if objective["name"] == "mars":
        about = "fine-tuned with the MARS objective"
    else:
        about = (
            f"trained with the {objective['name']!r} objective, not MARS: its masks carry no "
            "information, so threshold decoding stays near one token per forward"
        )
    lines = [
        "---",
        *metadata,
        "---",
        "",
        "# MARS checkpoint",
        "",
        f"A causal LM ({family} architecture) "
        f"{about} (Mask AutoRegression, [arXiv 2604.07023](https://arxiv.org/abs/2604.07023)), "
        "exported by mars-jax. MARS adds no parameters or heads: one checkpoint decodes exactly "
        "like an autoregressive model one token per forward, or several tokens per forward where "
        "it is confident.",
        "",
        "| | |",
        "|---|---|",
        f"| block size (most tokens per forward, as trained) | {block_size} |",
        f"| mask token | `{mask_token}` (id {tok.mask_id}) |",
        f"| objective | {objective['name']}, ar_weight {objective['ar_weight']}, "
        f"{objective['normalization']} normalization |",
        f"| initialized from | {run_config.get('init_from') or 'random initialization'} |",
        f"| exported from | run `{workdir}`, step {step} |",
        "",
        "config.json records `mask_token_id` and `mars_block_size`; generation_config.json makes "
        "`generate` greedy and stop at "
        + " or ".join(f"`{tok.id_to_token(i)}` ({i})" for i in tok.eos_ids)
        + ".",
        "",
        "## Recommended thresholds",
        "",
        "A block's candidate tokens are accepted left to right while the model's confidence is at "
        "least the threshold.",
        "",
        "- **1.0**: exact AR decoding, token for token the greedy output, one token per forward.",
        "- **0.95** / **0.9**: several tokens per forward where the model is confident, trading "
        "some agreement with AR (and possibly accuracy) for fewer forwards; check on your data.",
        "",
    ]
    if eval_report is not None:
        lines += [
            f"## Evaluation (step {eval_report['step']})",
            "",
            plots.format_table(eval_report),
            "",
        ]
    lines += [
        "## Decoding with MARS",
        "",
        "With mars-jax's decoder, from this directory:",
        "",
        "```python",
        "from mars_jax import decode, huggingface",
        "from mars_jax.tokenizer import load_tokenizer",
        "",
        'path = "."  # this directory',
        "model, tok = huggingface.load_hf(path), load_tokenizer(path)",
        'messages = [{"role": "user", "content": "What is 12 * 7?"}]',
        "prompt = tok.apply_chat_template(messages, add_generation_prompt=True)",
        "out = decode.generate_batched(",
        f"    model, [prompt], batch_size=1, block_size={block_size}, threshold=0.95,",
        "    max_new_tokens=256, mask_id=tok.mask_id, eos_ids=tok.eos_ids, pad_id=tok.pad_id,",
        ")",
        "print(tok.decode(out.completions()[0]), out.tokens_per_forward)",
        "```",
        "",
        "or from the training run: `python -m mars_jax.generate "
        f'--workdir={workdir} --prompt="What is 12 * 7?" --threshold=0.95`.',
        "",
        "Plain `transformers` `generate()` (or any AR serving stack) decodes it as an "
        "autoregressive model, one token per forward, the same as threshold 1.0.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    """``python -m mars_jax.export --workdir=DIR --output=DIR [--step=N] [--dtype=bfloat16]
    [--base_model=HUB_ID]``."""
    workdir = cli.workdir_flag()
    output = flags.DEFINE_string("output", None, "Output directory.", required=True)
    step = cli.step_flag()
    dtype = flags.DEFINE_string("dtype", None, "Weight dtype to save (default: param dtype).")
    base_model = flags.DEFINE_string(
        "base_model", None, "Hub id of the model the run started from, for the model card."
    )
    cli.run(
        lambda: export_run(
            workdir.value,
            output.value,
            step=step.value,
            dtype=dtype.value,
            base_model=base_model.value,
        )
    )


if __name__ == "__main__":
    main()
