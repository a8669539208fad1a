r"""Evaluation: accuracy and speed of threshold decoding, and teacher-forced NLL.

  python -m mars_jax.evaluate --config=configs/tiny.py --workdir=runs/mars

Restores the latest checkpoint of ``workdir``, decodes ``eval.num_examples`` evaluation prompts
(GSM8K test questions, or held-out synthetic problems) at each of ``eval.thresholds`` and
reports per threshold: accuracy (the number after ``####``, else the last number), tokens per
forward, generated tokens/s, mean completion length, and agreement with the threshold-1.0
(one-token, i.e. AR) output, decoding with ``eval.cache_mode`` and ``eval.rule`` (see
`mars_jax.decode`); once per checkpoint, the mean per-token negative log-likelihood
of the reference answers under plain AR teacher forcing (paper Sec. 5 reports accuracy and
tokens per forward). With ``eval.temperature`` > 0, prompt i samples with seed ``seed + i``
(`decode.generate_batched`), whatever ``eval.batch_size``. Everything is also written to
``workdir/eval.json``.

From Python: ``evaluate.evaluate(config, workdir)`` with the run's ``ConfigDict``.
"""

from __future__ import annotations

import json
import os
import re
import time
import types

import jax
import numpy as np
from absl import logging

from mars_jax import cli, data, decode, workdir as wd
from mars_jax.objectives import ar_loss

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
    """The final answer of a GSM8K-style completion: the number after ``####``, else the last
    number in the text; commas and a trailing ".0" removed. None when there is no number."""
    tail = text.split("####", 1)[1] if "####" in text else text
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    number = (numbers[0] if "####" in text else numbers[-1]).replace(",", "")
    return number[:-2] if number.endswith(".0") else number


def teacher_forced_nll(model, tok, examples, *, max_length: int, batch_size: int) -> float:
    """Mean per-token NLL (nats) of the reference answers (+ <|im_end|>) under AR teacher forcing."""
    rows = [
        {"messages": prompt + [{"role": "assistant", "content": answer}]}
        for prompt, answer in examples
    ]
    tokenized, _ = data.build_examples(
        rows, tok, "messages", max_length=max_length, block_size=1, source_name="eval"
    )
    obj = types.SimpleNamespace(max_label_tokens=None, normalization="token", ce_chunk_size=0)
    loss = jax.jit(lambda m, b: ar_loss(m, b, obj)[1])
    total, count = 0.0, 0
    ds = data.batched_dataset(
        tokenized,
        batch_size=batch_size,
        max_length=max_length,
        seed=0,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
    )
    for batch in ds:
        metrics = jax.device_get(loss(model, batch))
        total += float(metrics["loss"]) * float(metrics["label_tokens"])
        count += int(metrics["label_tokens"])
    return total / max(count, 1)


def evaluate(cfg, workdir: str, step: int | None = None) -> dict:
    """Runs the evaluation described in the module docstring on checkpoint ``step`` (default:
    the latest) of ``workdir``, with the ``data`` and ``eval`` sections of run config ``cfg``.

    Prints the table, writes ``workdir/eval.json`` and returns the report: {workdir, step,
    num_examples, block_size, cache_mode, rule, ar_nll, results: [{threshold, accuracy,
    tokens_per_forward, tokens_per_s, mean_length, agreement_with_ar, examples}]}. Raises FileNotFoundError for a
    workdir without checkpoints, ValueError when the evaluation source yields no examples.
    """
    model, tok, step = wd.load_model(workdir, step=step)
    e = cfg.eval
    source, fmt, seed = data.eval_source(cfg)
    examples = data.eval_examples(source, num_examples=e.num_examples, fmt=fmt, seed=seed)
    if not examples:
        raise ValueError(
            f"no evaluation examples in {source} read as {fmt!r} rows "
            "(set data.eval_format to the file's row format)"
        )
    block_size = e.block_size or wd.trained_block_size(workdir)
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m, _ in examples]
    references = [extract_answer(answer) for _, answer in examples]

    def run(threshold):
        return decode.generate_batched(
            model,
            prompts,
            batch_size=e.batch_size,
            pad_id=tok.pad_id,
            block_size=block_size,
            threshold=threshold,
            max_new_tokens=e.max_new_tokens,
            temperature=e.temperature,
            cache_mode=e.cache_mode,
            rule=e.rule,
            seed=cfg.seed,
            mask_id=tok.mask_id,
        )

    # Compiles once (threshold is a traced argument) and gives the one-token (AR) reference.
    logging.info("compiling the decoder and decoding the threshold-1.0 reference")
    reference_outputs = run(1.0).completions()
    results = []
    for threshold in e.thresholds:
        logging.info("decoding %d prompts at threshold %.2f", len(prompts), threshold)
        start = time.perf_counter()
        out = run(threshold)
        seconds = time.perf_counter() - start
        outputs = out.completions()
        texts = [tok.decode(o) for o in outputs]
        correct = [r is not None and extract_answer(t) == r for t, r in zip(texts, references)]
        results.append(
            {
                "threshold": float(threshold),
                "accuracy": float(np.mean(correct)),
                "tokens_per_forward": out.tokens_per_forward,
                "tokens_per_s": float(out.accepted.sum() / seconds),
                "mean_length": float(np.mean(out.lengths)),
                "agreement_with_ar": float(
                    np.mean([o == r for o, r in zip(outputs, reference_outputs)])
                ),
                "examples": [
                    {"completion": t, "answer": extract_answer(t), "reference": r}
                    for t, r in zip(texts[:3], references[:3])
                ],
            }
        )
    nll = teacher_forced_nll(
        model,
        tok,
        examples[: e.nll_examples],
        max_length=cfg.data.max_length,
        batch_size=e.batch_size,
    )
    report = {
        "workdir": workdir,
        "step": step,
        "num_examples": len(examples),
        "block_size": block_size,
        "cache_mode": e.cache_mode,
        "rule": e.rule,
        "ar_nll": nll,
        "results": results,
    }
    print(format_table(report))
    with open(os.path.join(workdir, "eval.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def format_table(report: dict) -> str:
    """The evaluation results as a Markdown table."""
    lines = [
        f"{report['workdir']} step {report['step']}: {report['num_examples']} examples, "
        f"block_size {report['block_size']}, AR teacher-forced NLL "
        f"{report['ar_nll']:.4f} nats/token",
        "| threshold | accuracy | tokens/forward | tokens/s | mean length | agreement with 1.0 |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['threshold']:.2f} | {r['accuracy']:.3f} | "
            f"{r['tokens_per_forward']:.2f} | {r['tokens_per_s']:.1f} | "
            f"{r['mean_length']:.1f} | {r['agreement_with_ar']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    """``python -m mars_jax.evaluate --config=CONFIG --workdir=DIR [--step=N]``."""
    config = cli.config_flag()
    workdir = cli.workdir_flag("Run directory to evaluate.")
    step = cli.step_flag()

    def run():
        logging.info("evaluating %s", workdir.value)
        evaluate(config.value, workdir.value, step.value)

    cli.run(run)


if __name__ == "__main__":
    main()
