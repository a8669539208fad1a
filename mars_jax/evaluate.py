r"""Evaluation: accuracy and speed of threshold decoding, and teacher-forced NLL.

  python -m mars_jax.evaluate --config=configs/tiny.py --workdir=runs/mars

Restores the latest checkpoint of ``workdir``, decodes ``eval.num_examples`` evaluation prompts
(GSM8K test questions, or held-out synthetic problems) at each of ``eval.thresholds`` and
reports per threshold: accuracy (the completion's final answer is numerically equal to the
reference's, `mars_jax.grading.answer_value`), tokens per forward, wall clock (below), mean
completion length, and agreement with the threshold-1.0 (one-token, i.e. AR) output, decoding
with ``eval.cache_mode`` and ``eval.rule`` (see `mars_jax.decode`); once per checkpoint, the
mean per-token negative log-likelihood of the reference answers under plain AR teacher forcing
(paper Sec. 5 reports accuracy and tokens per forward). With ``eval.temperature`` > 0, prompt i
samples with seed ``seed + i`` (`decode.generate_batched`), whatever ``eval.batch_size``.
Everything is also written to ``DIR/eval/step_<step>_<UTC time>.json`` (one file per
evaluation, so that earlier evaluations, at other thresholds or steps, are kept) and copied to
``DIR/eval.json`` (the latest evaluation), each with the Pareto plot of its thresholds beside it
(``.png``: accuracy against tokens per forward); see `write_report`. DIR is ``--output_dir``, or
else ``workdir`` when it is a run directory (training's own); a model read from elsewhere (a
Hugging Face directory, a model cache) is never written into: without ``--output_dir`` its report
is printed only.
``eval.thresholds`` must each lie in (0, 1]; they are checked before anything is loaded.

Wall clock (``eval.timing_repeats`` >= 1; 0 decodes each threshold once, untimed, and leaves the
speed fields out): each decoder program (one per block size) is compiled by an untimed warm-up
decode; then each threshold's decode of all the prompts is timed ``eval.timing_repeats`` times and the
fastest counts (``seconds``; ``tokens_per_s`` = generated tokens / seconds). AR decoding of the
same prompts (block size 1, threshold 1.0, the same cache mode), timed the same way in the same
run, is the baseline: ``speedup`` = tokens_per_s / ``ar_tokens_per_s`` and ``conversion`` =
speedup / tokens_per_forward (the share of the fewer forwards that became wall-clock speedup).

From Python: ``evaluate.evaluate(config, workdir)`` with the run's ``ConfigDict``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import jax
import numpy as np
from absl import flags, logging

from mars_jax import cli, config, decode, platforms, plots, sources, storage
from mars_jax import workdir as wd
from mars_jax.batches import batched_dataset, build_examples, eval_examples, eval_source
from mars_jax.decode_options import DecodeOptions
from mars_jax.errors import AlreadyExists, InputError
from mars_jax.grading import accuracy, extract_answer
from mars_jax.objectives import ar_loss

# Wall-clock measurements, in a result row or at the top of a report: they differ between two
# evaluations of the same checkpoint.
WALL_CLOCK_KEYS = (
    "tokens_per_s",
    "seconds",
    "speedup",
    "conversion",
    "ar_tokens_per_s",
    "ar_seconds",
)


def teacher_forced_nll(model, tok, examples, *, max_length: int, batch_size: int) -> float:
    """Mean per-token NLL (nats) of the reference answers (+ <|im_end|>) under AR teacher forcing."""
    rows = [
        {"messages": prompt + [{"role": "assistant", "content": answer}]}
        for prompt, answer in examples
    ]
    tokenized, _ = build_examples(
        rows, tok, "messages", max_length=max_length, block_size=1, source_name="eval"
    )
    obj = config.ObjectiveConfig(name="ar", normalization="token", max_label_tokens=None)
    loss = jax.jit(lambda m, b: ar_loss(m, b, obj)[1])
    total, count = 0.0, 0
    ds = batched_dataset(
        tokenized,
        batch_size=batch_size,
        max_length=max_length,
        seed=0,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        pad_id=tok.pad_id,
    )
    for batch in ds:
        metrics = jax.device_get(loss(model, batch))
        total += float(metrics["loss"]) * float(metrics["label_tokens"])
        count += int(metrics["label_tokens"])
    return total / max(count, 1)


def write_report(workdir: str, report: dict) -> str:
    """Writes ``report`` as a new file ``workdir/eval/step_<step>_<UTC time>.json`` (a
    ``_<n>`` suffix where that name is taken; an existing file is never overwritten) and copies
    it to ``workdir/eval.json``, the latest evaluation. Beside each, the same name with ".png"
    holds the Pareto plot of the report's thresholds (`plots.pareto_plot`: accuracy against
    tokens per forward). Returns the new JSON file's path."""
    directory = storage.join(workdir, "eval")
    storage.makedirs(directory)
    stem = f"step_{report['step']}_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    text = json.dumps(report, indent=2)
    for n in range(1000):
        path = storage.join(directory, stem + (f"_{n}" if n else "") + ".json")
        try:
            storage.create_new(path, text)  # never overwrites (gs://: a generation precondition)
            break
        except FileExistsError:
            continue
    else:
        raise AlreadyExists(f"{directory}: too many evaluations named {stem}_*.json")
    storage.write_text(storage.join(workdir, "eval.json"), text)
    with tempfile.TemporaryDirectory(prefix="mars_jax_") as tmp:
        local = os.path.join(tmp, "plot.png")
        plots.pareto_plot(
            {report["workdir"]: report["results"]},
            local,
            title=f"{report['workdir']} step {report['step']}\n{report['num_examples']} "
            f"examples, block size {report['block_size']}, {report['cache_mode']} cache, "
            f"{report['rule']} rule",
        )
        with open(local, "rb") as f:
            image = f.read()
    storage.write_bytes(os.path.splitext(path)[0] + ".png", image)
    storage.write_bytes(storage.join(workdir, "eval.png"), image)
    return path


def best_of(decode_fn, repeats: int):
    """Calls ``decode_fn()`` ``repeats`` (>= 1) times; returns (the first call's result, the
    fewest seconds one call took). ``decode_fn`` must return host values (it is not synced)."""
    result, best = None, float("inf")
    for i in range(repeats):
        start = time.perf_counter()
        out = decode_fn()
        best = min(best, time.perf_counter() - start)
        result = out if i == 0 else result
    return result, best


@platforms.releases_host_memory
def evaluate(cfg, workdir: str, step: int | None = None, output_dir: str | None = None) -> dict:
    """Runs the evaluation described in the module docstring on checkpoint ``step`` (default:
    the latest) of ``workdir``, with the ``data`` and ``eval`` sections of run config ``cfg``.

    Prints the table, writes it (`write_report`: a new ``DIR/eval/step_*.json`` and
    ``DIR/eval.json``, each with its Pareto plot ``.png``; DIR: ``output_dir``, else ``workdir``
    if it is a run directory, else nothing is written) and returns the report:
    {workdir, step, num_examples, block_size, cache_mode, rule, ar_nll, timing_repeats,
    ar_tokens_per_s, ar_seconds, results: [{threshold, accuracy, tokens_per_forward,
    tokens_per_s, seconds, speedup, conversion, mean_length, agreement_with_ar, examples}]}
    (seconds: the fastest of ``eval.timing_repeats`` decodes of all the prompts; tokens/s:
    generated tokens, EOS included, per second; see the module docstring).
    Raises FileNotFoundError for a workdir without checkpoints, ValueError when the evaluation
    source yields no examples; first `errors.SettingError` / `errors.MissingPath` for a bad
    setting (`config.validate`: eval.thresholds outside (0, 1], an unknown eval.rule or
    eval.cache_mode among them), before anything is loaded.
    """
    config.validate(cfg, training=False)
    e = cfg.eval
    thresholds = [float(t) for t in e.thresholds]  # checked by config.validate
    opened = sources.open(workdir, block_size=e.block_size or None, step=step)
    model, tok, step, block_size = opened.model, opened.tokenizer, opened.step, opened.block_size
    source, fmt, seed = eval_source(cfg)
    examples = eval_examples(source, num_examples=e.num_examples, fmt=fmt, seed=seed)
    if not examples:
        raise InputError(
            f"no evaluation examples in {source} read as {fmt!r} rows "
            "(set data.eval_format to the file's row format)"
        )
    prompts = []
    for i, (messages, _) in enumerate(examples):
        try:
            prompts.append(tok.apply_chat_template(messages, add_generation_prompt=True))
        except ValueError as e:  # e.g. a token outside a trimmed run's vocabulary
            raise InputError(f"{source}: evaluation example {i}: {e}") from None
    references = [answer for _, answer in examples]

    def run(threshold, block_size=block_size):
        return decode.generate_batched(
            model,
            prompts,
            DecodeOptions.from_eval(e, block_size=block_size, threshold=threshold),
            batch_size=e.batch_size,
            seed=cfg.seed,
            **opened.decode_ids(),
        )

    timed = {}  # (block size, threshold) -> (DecodeOutput, best seconds)
    planned = len({(1, 1.0)} | {(block_size, t) for t in thresholds})
    started = []  # when the first timed decode began

    def timed_run(threshold, block_size=block_size):
        key = (block_size, threshold)
        if key not in timed:
            logging.info(
                "decoding %d prompts at block size %d, threshold %.2f, best of %d",
                len(prompts),
                block_size,
                threshold,
                e.timing_repeats,
            )
            started[:] = started or [time.perf_counter()]
            timed[key] = best_of(lambda: run(threshold, block_size), e.timing_repeats)
            # Progress and an estimate of what is left (the decodes of the thresholds to come
            # at this one's mean pace; the NLL pass after them is not counted).
            elapsed = time.perf_counter() - started[0]
            left = elapsed / len(timed) * (planned - len(timed))
            logging.info(
                "%d of %d timed decodes done in %.0f s; about %.0f s left",
                len(timed),
                planned,
                elapsed,
                left,
            )
        return timed[key]

    ar_tokens_per_s = ar_seconds = None
    if e.timing_repeats:
        # Warm-ups, untimed: compile once per block size (threshold is a traced argument); the
        # first gives the one-token (threshold-1.0) reference.
        logging.info("compiling the decoder and decoding the threshold-1.0 reference")
        reference_outputs = run(1.0).completions()
        if block_size != 1:
            logging.info("compiling the AR (block size 1) decoder")
            run(1.0, 1)
        ar_out, ar_seconds = timed_run(1.0, 1)
        ar_tokens_per_s = float(ar_out.accepted.sum() / ar_seconds)
        # At block size 1 and threshold 1.0 this is the AR baseline's own measurement.
        decoded = {t: timed_run(t) for t in thresholds}
    else:
        # Untimed: each threshold decoded once, the threshold-1.0 one the reference.
        decoded = {}  # threshold -> (DecodeOutput, None)
        for threshold in sorted(set(thresholds) | {1.0}, reverse=True):
            logging.info(
                "decoding %d prompts at block size %d, threshold %.2f (untimed)",
                len(prompts),
                block_size,
                threshold,
            )
            decoded[threshold] = (run(threshold), None)
        reference_outputs = decoded[1.0][0].completions()
    results = []
    for threshold in thresholds:
        out, seconds = decoded[threshold]
        outputs = out.completions()
        texts = [tok.decode(o) for o in outputs]
        speed = {}
        if seconds is not None:
            tokens_per_s = float(out.accepted.sum() / seconds)
            speedup = tokens_per_s / ar_tokens_per_s
            speed = {
                "tokens_per_s": tokens_per_s,
                "seconds": seconds,
                "speedup": speedup,
                "conversion": speedup / out.tokens_per_forward,
            }
        results.append(
            {
                "threshold": float(threshold),
                "accuracy": accuracy(texts, references),
                "tokens_per_forward": out.tokens_per_forward,
                **speed,
                "mean_length": float(np.mean(out.lengths)),
                "agreement_with_ar": float(
                    np.mean([o == r for o, r in zip(outputs, reference_outputs)])
                ),
                "examples": [
                    {"completion": t, "answer": extract_answer(t), "reference": extract_answer(r)}
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
        "timing_repeats": e.timing_repeats,
        "ar_tokens_per_s": ar_tokens_per_s,
        "ar_seconds": ar_seconds,
        "results": results,
    }
    print(plots.format_table(report))
    out = output_dir or (workdir if wd.is_workdir(workdir) else None)
    if out is None:
        logging.info(
            "%s is not a run directory: the report is not written into the model it reads "
            "(--output_dir keeps it)",
            workdir,
        )
    else:
        logging.info("wrote %s", write_report(out, report))
    return report


def main() -> None:
    """``python -m mars_jax.evaluate --config=CONFIG --workdir=DIR [--step=N] [--output_dir=D]``."""
    config = cli.config_flag()
    workdir = cli.workdir_flag("Run directory (or model directory) to evaluate.")
    step = cli.step_flag()
    output_dir = flags.DEFINE_string(
        "output_dir",
        None,
        "Where the report goes (default: the run directory; a model directory is never written).",
    )

    def run():
        logging.info("evaluating %s", workdir.value)
        evaluate(config.value, workdir.value, step.value, output_dir.value)

    cli.run(run)


if __name__ == "__main__":
    main()
