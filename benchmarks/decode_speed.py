r"""Decode speed: AR with a KV cache, the MARS decoders and transformers, side by side.

  PYTHONPATH=. python benchmarks/decode_speed.py --model=both \
      --workdir=runs/tiny/mars --config=configs/tiny.py --output_dir=benchmarks/results

With the defaults this takes hours on 2 CPU cores (the trained model decodes 64 prompts of up
to 128 tokens per configuration, one at a time at batch 1); --batch_sizes, --decoders,
--thresholds, --num_prompts and --max_new_tokens make shorter runs.

For each model and batch size, one process decodes the same prompts, on the same weights and
with the same completion budget, with every decoder:

  ar            block_size 1, threshold 1.0: one token per forward over a one-token window with
                the KV cache (`decode.generate`), the baseline of every speedup;
  sliding       MARS threshold decoding, per-row sliding windows over the KV cache (a B-slot
                window on steps where every row needs no more, else 2B-1 slots);
  sliding_fixed the same with the window always 2B-1 slots (``adaptive_window=False``): what
                the adaptive window saves;
  block         MARS with the reference's block-aligned cache (rows wait for each other at block
                ends, and one more forward per block writes it to the cache);
  none          MARS without a KV cache (every forward runs the whole sequence; on
                qwen0_5b_shape only up to batch 4, as a full recompute of 64 rows takes tens
                of minutes on a CPU and its cost is plain from the roofline note);
  verify        lossless rule "verify" over the sliding cache: the threshold chooses the drafts
                that the next forward checks against its own AR predictions, so the output is
                ar's (same_as_ar 1.0) and only the number of forwards changes;
  transformers  transformers' ``Qwen2ForCausalLM.generate`` (PyTorch, greedy, ``use_cache=True``)
                on the same weights exported to Hugging Face format and loaded in float32.

MARS decoders run at the run's trained block size and at each ``--thresholds``. Models:

  trained         a trained run (``--workdir``) on ``--num_prompts`` evaluation prompts of the
                  ``--config``'s eval data (chat template applied), ``--max_new_tokens`` each;
  qwen0_5b_shape  random weights (``--shape_dtype``, fp32 by default) of configs/qwen0_5b.py's
                  architecture (block size 8) on random prompts of ``--shape_prompt_len``
                  tokens, ``--shape_max_new_tokens`` each, one batch per batch size. Its MARS
                  acceptance is meaningless (random weights accept one token per forward at any
                  threshold < 1, so its MARS rows are timed at the lowest threshold only): its
                  point is step_ms, the cost of a step. ``qwen7b_shape`` and ``tiny_shape``
                  are the same for configs/qwen7b.py and configs/tiny.py.

``--accept=K,...`` runs the fixed-acceptance step table of benchmarks/decode_step.py instead
(every row accepts exactly K tokens per forward; flags --shapes, --dtypes, --batch_sizes,
--block_sizes, --modes, --steps, --prompt_len, --repeats; --parts also times a step's pieces).
transformers runs on the GPU when torch has one, in the model's dtype.

Fairness. Every decoder of a model gets the same prompt token ids and the same stopping rule.
The trained model stops each row at <|im_end|> or <|endoftext|> in every decoder, transformers
included (its ``eos_token_id``), so ``transformers`` and ``ar`` do the same work: the same
greedy tokens (column same_as_ar, the fraction of rows whose completion equals ar's, checks
it) and the same number of forwards (a batch runs until its longest row ends in both). MARS
decoders may change the text and so the lengths; tokens_per_s divides the tokens they did
generate by their time. The random model has no EOS in any decoder (transformers gets
``eos_token_id=None``): every row generates exactly the budget, so its rows time equal work.
transformers gets the prompts left-padded (with an attention mask, positions from it) to the
width our decoders right-pad to: the same prefill. Remaining differences, all against us:
transformers' first token comes from its prefill, ours from one extra one-token forward after
it; our cache is a fixed-size array attended in full at every step (transformers' grows).
transformers runs eagerly (a Python loop per token, no static cache, no torch.compile) with
``torch.get_num_threads()`` threads; ours is one compiled XLA program per configuration.

Timing: per model and batch size, each configuration runs once untimed (compilation,
allocation); then ``--repeats`` rounds run every configuration once, in turn (so that a shared
machine's changing load favours none), and each reports its fastest run. Columns:
  tokens_per_forward  generated tokens (EOS included) / forwards in which a row was active;
  prefill_ms          the prefill of the batches alone (our jitted prefill forward, or
                      transformers' first forward; 0 for none, which has no prefill);
  step_ms             (wall milliseconds - prefill_ms) / decoding forwards of the batches
                      (transformers' first token comes from its prefill: its decoding
                      forwards are one fewer per batch);
  tokens_per_s        generated tokens (EOS included) / wall seconds;
  speedup             tokens_per_s / that of ar at the same model and batch;
  conversion          speedup / tokens_per_forward: the fraction of the ideal speedup kept
                      (1.0 when a MARS step costs as much as an AR step);
  same_as_ar          fraction of rows whose completion equals ar's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
import os
import tempfile
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from benchmarks import common, decode_step
from mars_jax import cli, decode, huggingface, sources
from mars_jax import config as config_lib
from mars_jax.batches import eval_examples, eval_source
from mars_jax.kv_cache import init_cache
from mars_jax.model import CausalLM
from mars_jax.tokenizer import ENDOFTEXT_ID, MASK_ID

MODELS = ("trained", "qwen0_5b_shape", "qwen7b_shape", "tiny_shape")
# MARS decoders: the `decode.generate` keywords besides block size and threshold.
MARS = {
    "sliding": dict(cache_mode="sliding", rule="prob"),
    "sliding_fixed": dict(cache_mode="sliding", rule="prob", adaptive_window=False),
    "block": dict(cache_mode="block", rule="prob"),
    "none": dict(cache_mode="none", rule="prob"),
    "verify": dict(cache_mode="sliding", rule="verify"),
}
AR = dict(cache_mode="sliding", rule="prob")  # with block_size 1 and threshold 1.0
DECODERS = ("ar", *MARS, "transformers")
KEYS = (
    "model",
    "decoder",
    "batch",
    "threshold",
    "block_size",
    "prompts",
    "max_new_tokens",
    "tokens",
    "forwards",
    "seconds",
    "prefill_ms",
    "tokens_per_forward",
    "step_ms",
    "tokens_per_s",
    "speedup",
    "conversion",
    "same_as_ar",
)


@dataclasses.dataclass
class Subject:
    """One model to benchmark with every decoder.

    model: our `CausalLM`; hf: the same weights as a transformers ``Qwen2ForCausalLM`` (float32).
    prompts: token-id lists; a batch size b decodes the first ``b * ceil(min_prompts / b)``
      (a whole number of full batches: no filler rows), so every decoder at b sees the same ones.
    block_size: MARS block size; max_new_tokens: completion budget per row (tokens).
    eos_ids: stop tokens of every decoder (empty: never stop); pad_id: prompt padding id;
      mask_id: the <|mask|> id MARS decoders append (all three in the model's ids: a trimmed
      run's differ from Qwen2.5's).
    min_prompts: prompts decoded per configuration, at least (see prompts).
    one_threshold: time MARS decoders at the lowest threshold only (meaningless acceptance).
    none_max_batch: largest batch size at which ``none`` (full recompute) is timed.
    """

    name: str
    model: CausalLM
    hf: object
    prompts: list[list[int]]
    block_size: int
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    mask_id: int | None  # None: not a MARS model (ar and transformers only)
    min_prompts: int = 1
    one_threshold: bool = False
    none_max_batch: int | None = None

    def prompts_for(self, batch: int) -> list[list[int]]:
        """The prompts that every configuration at batch size ``batch`` decodes."""
        return self.prompts[: batch * math.ceil(self.min_prompts / batch)]


def load_transformers(model: CausalLM, *, eos_ids: Sequence[int], pad_id: int):
    """``model``'s weights exported (`huggingface.export_hf`) and loaded as a transformers
    ``Qwen2ForCausalLM`` in the model's compute dtype (on the GPU where torch has one) whose
    generation config is greedy, cached, stops at ``eos_ids`` (never when empty) and pads with
    ``pad_id``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = getattr(torch, model.cfg.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as path:
        huggingface.export_hf(model, path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    # Set on the model itself: generate() fills unset (None) values from it.
    hf.generation_config = GenerationConfig(
        do_sample=False, use_cache=True, eos_token_id=list(eos_ids) or None, pad_token_id=pad_id
    )
    return hf


def make_subject(
    name: str,
    model: CausalLM,
    prompts,
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    **fields,
) -> Subject:
    """A `Subject` of ``model`` with its transformers twin (`load_transformers`); ``fields``
    are the other `Subject` fields."""
    hf = load_transformers(model, eos_ids=eos_ids, pad_id=pad_id)
    return Subject(
        name, model, hf, [list(p) for p in prompts], eos_ids=tuple(eos_ids), pad_id=pad_id, **fields
    )


def build_subjects(
    names: Sequence[str],
    *,
    batch_sizes: Sequence[int],
    workdir: str | None = None,
    config=None,
    block_size: int | None = None,
    num_prompts: int = 64,
    max_new_tokens: int = 128,
    shape_prompt_len: int = 40,
    shape_max_new_tokens: int = 16,
    shape_dtype: str = "float32",
) -> list[Subject]:
    """The models ``names`` (`MODELS`) and their prompts (module docstring)."""
    subjects = []
    for name in names:
        if name == "trained":
            if not workdir:
                raise ValueError("--model=trained needs --workdir (a trained run)")
            opened = sources.open(workdir, block_size=block_size)
            tok = opened.tokenizer
            need = max(b * math.ceil(num_prompts / b) for b in batch_sizes)
            source, fmt, seed = eval_source(config)
            examples = eval_examples(source, num_examples=need, fmt=fmt, seed=seed)
            prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m, _ in examples]
            prompts = [prompts[i % len(prompts)] for i in range(need)]
            subjects.append(
                make_subject(
                    name,
                    opened.model,
                    prompts,
                    block_size=opened.block_size,
                    max_new_tokens=max_new_tokens,
                    eos_ids=opened.stop_ids,
                    pad_id=opened.pad_id,
                    mask_id=opened.mask_id,
                    min_prompts=num_prompts,
                )
            )
        elif name.endswith("_shape") and name[: -len("_shape")] in decode_step.SHAPES:
            shape = name[: -len("_shape")]
            cfg = decode_step.model_config(shape, shape_dtype)
            block_size = (
                importlib.import_module(f"configs.{shape}").get_config("mars").objective.block_size
            )
            rng = np.random.default_rng(0)
            prompts = rng.integers(0, ENDOFTEXT_ID, (max(batch_sizes), shape_prompt_len))
            subjects.append(
                make_subject(
                    name,
                    nnx.merge(*common.random_params(cfg)),
                    prompts.tolist(),
                    block_size=block_size,
                    max_new_tokens=shape_max_new_tokens,
                    eos_ids=(),
                    pad_id=ENDOFTEXT_ID,
                    mask_id=MASK_ID,
                    one_threshold=True,
                    none_max_batch=4,
                )
            )
        else:
            raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    return subjects


def transformers_generate(
    hf, prompts, *, batch_size: int, max_new_tokens: int, eos_ids: Sequence[int], pad_id: int
) -> decode.DecodeOutput:
    """Greedy ``hf.generate`` of ``prompts`` in batches, left-padded to the longest prompt with
    an attention mask, as a `decode.DecodeOutput` (cut before the first of ``eos_ids``;
    forwards = generated positions of each batch, its prefill included)."""
    import torch

    width = max(map(len, prompts))
    outputs = []
    for ids, mask in _padded_batches(prompts, batch_size, pad_id, left=True):
        with torch.inference_mode():
            seq = hf.generate(
                input_ids=torch.from_numpy(ids).to(hf.device),
                attention_mask=torch.from_numpy(mask).to(hf.device),
                max_new_tokens=max_new_tokens,
            )
        gen = seq[:, width:].cpu().numpy().astype(np.int32)
        n = gen.shape[1]
        is_eos = np.isin(gen, np.asarray(eos_ids, np.int32))
        lengths = np.where(is_eos.any(1), is_eos.argmax(1), n).astype(np.int32)
        accepted = np.where(is_eos.any(1), lengths + 1, n).astype(np.int32)
        tokens = np.full((len(ids), max_new_tokens), ENDOFTEXT_ID, np.int32)
        for r, length in enumerate(lengths):
            tokens[r, :length] = gen[r, :length]
        outputs.append(decode.DecodeOutput(tokens, lengths, accepted, accepted, n))
    return decode.DecodeOutput.concatenate(outputs)


def _padded_batches(prompts, batch_size: int, pad_id: int, left: bool = False):
    """The prompts as int arrays [batch_size, longest prompt] (right-padded, or left-padded for
    transformers) and a 0/1 mask of the prompt tokens, batch after batch."""
    width = max(map(len, prompts))
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids = np.full((len(chunk), width), pad_id, np.int64)
        mask = np.zeros_like(ids)
        for r, p in enumerate(chunk):
            at = slice(width - len(p), width) if left else slice(0, len(p))
            ids[r, at], mask[r, at] = p, 1
        yield ids, mask


@functools.partial(jax.jit, static_argnames=("graphdef", "slots"))
def _jax_prefill(graphdef, params, ids, *, slots: int):
    """The decoder's prefill: every prompt slot's key/value written to a cache of ``slots``."""
    model = nnx.merge(graphdef, params)
    rows, width = ids.shape
    pos = jnp.broadcast_to(jnp.arange(width), (rows, width))
    cache = init_cache(model.cfg, rows, slots)
    return model(ids, pos, None, cache)[1]


def prefill_run(s: Subject, family: str, *, batch: int, block_size: int):
    """A function that runs only the prefill of every batch of ``s.prompts_for(batch)``: ours
    (``family`` "jax", the cache sized as `decode.generate` sizes it for ``block_size``) or
    transformers' first forward ("transformers")."""
    prompts = s.prompts_for(batch)
    if family == "transformers":
        import torch

        batches = list(_padded_batches(prompts, batch, s.pad_id, left=True))

        def run():
            with torch.inference_mode():
                for ids, mask in batches:
                    s.hf(
                        input_ids=torch.from_numpy(ids).to(s.hf.device),
                        attention_mask=torch.from_numpy(mask).to(s.hf.device),
                        use_cache=True,
                        logits_to_keep=1,
                    )  # as generate: the last only
                if s.hf.device.type == "cuda":
                    torch.cuda.synchronize()

        return run
    graphdef, params = nnx.split(s.model)
    width = max(map(len, prompts))
    slots = width + s.max_new_tokens + 2 * (2 * block_size - 1)
    batches = [jnp.asarray(ids, jnp.int32) for ids, _ in _padded_batches(prompts, batch, s.pad_id)]
    return lambda: [
        jax.block_until_ready(_jax_prefill(graphdef, params, ids, slots=slots)) for ids in batches
    ]


def decoder_run(s: Subject, decoder: str, *, batch: int, threshold: float):
    """One configuration: a function that decodes ``s.prompts_for(batch)`` with ``decoder``
    (`DECODERS`) at ``threshold`` and returns its `decode.DecodeOutput`."""
    prompts = s.prompts_for(batch)
    common = dict(
        batch_size=batch, pad_id=s.pad_id, max_new_tokens=s.max_new_tokens, eos_ids=s.eos_ids
    )
    if decoder == "transformers":
        return lambda: transformers_generate(s.hf, prompts, **common)
    block_size, kwargs = (s.block_size, MARS[decoder]) if decoder in MARS else (1, AR)
    return lambda: decode.generate_batched(
        s.model,
        prompts,
        block_size=block_size,
        threshold=threshold,
        mask_id=s.mask_id,
        **kwargs,
        **common,
    )


def best_seconds(runs, repeats: int) -> list[float]:
    """The fastest wall seconds of each of ``runs`` over ``repeats`` rounds; each round runs
    every one once, in turn, so that a shared machine's changing load favours none."""
    best = [math.inf] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def benchmark(
    subjects: Sequence[Subject],
    *,
    batch_sizes: Sequence[int],
    thresholds: Sequence[float],
    decoders: Sequence[str] = DECODERS,
    repeats: int = 2,
    on_rows=None,
) -> list[dict]:
    """Every (model, batch, decoder, threshold) row, with all of `KEYS`. ar (the speedup
    baseline) is always included, ar and transformers at threshold 1.0 only. Per model and
    batch, every configuration runs once untimed (compilation), then `best_seconds`;
    ``on_rows`` (if given) gets every row so far after each batch size."""
    rows = []
    for s in subjects:
        mars = [min(thresholds)] if s.one_threshold else list(thresholds)
        for batch in batch_sizes:
            configs = [
                (d, t)
                for d in DECODERS
                if d == "ar" or d in decoders
                if not (d == "none" and batch > (s.none_max_batch or batch))
                if not (d in MARS and s.mask_id is None)  # a plain AR model: ar, transformers
                for t in (mars if d in MARS else [1.0])
            ]
            prefills = {"jax_1": prefill_run(s, "jax", batch=batch, block_size=1)}
            if s.mask_id is not None:
                prefills["jax_b"] = prefill_run(s, "jax", batch=batch, block_size=s.block_size)
            if "transformers" in decoders:
                prefills["transformers"] = prefill_run(s, "transformers", batch=batch, block_size=1)
            runs = [decoder_run(s, d, batch=batch, threshold=t) for d, t in configs]
            outs = []
            for (decoder, threshold), run in zip(configs, runs):
                outs.append(run())
                common.progress(f"{s.name} batch {batch} {decoder} {threshold}: compiled, ran")
            for run in prefills.values():
                run()
            seconds = best_seconds(runs + list(prefills.values()), repeats)
            common.progress(f"{s.name} batch {batch}: timed")
            prefill = dict(zip(prefills, seconds[len(runs) :]))
            ar = outs[0].accepted.sum() / seconds[0]
            for (decoder, threshold), out, sec in zip(configs, outs, seconds):
                tokens = int(out.accepted.sum())
                speedup = tokens / sec / ar
                pre = {"ar": prefill["jax_1"], "none": 0.0}.get(
                    decoder, prefill.get(decoder, prefill.get("jax_b", 0.0))
                )
                # transformers' first token comes from its prefill.
                steps = out.forwards - (len(out.lengths) // batch) * (decoder == "transformers")
                same = [a == b for a, b in zip(out.completions(), outs[0].completions())]
                rows.append(
                    dict(
                        model=s.name,
                        decoder=decoder,
                        batch=batch,
                        threshold=threshold,
                        block_size=s.block_size if decoder in MARS else 1,
                        prompts=len(out.lengths),
                        max_new_tokens=s.max_new_tokens,
                        tokens=tokens,
                        forwards=out.forwards,
                        seconds=sec,
                        prefill_ms=1e3 * pre,
                        tokens_per_forward=out.tokens_per_forward,
                        step_ms=1e3 * (sec - pre) / max(steps, 1),
                        tokens_per_s=tokens / sec,
                        speedup=float(speedup),
                        conversion=float(speedup / out.tokens_per_forward),
                        same_as_ar=float(np.mean(same)),
                    )
                )
            if on_rows is not None:
                on_rows(rows)
    return rows


def markdown(rows: Sequence[dict]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| model | decoder | batch | threshold | tokens/forward | step ms | tokens/s | "
        "speedup | conversion | same as AR |",
        "|---" * 10 + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['decoder']} | {r['batch']} | {r['threshold']:.2f} | "
            f"{r['tokens_per_forward']:.2f} | {r['step_ms']:.1f} | {r['tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f}x | {r['conversion']:.2f} | {r['same_as_ar']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict], path: str) -> None:
    """Speedup over ar vs batch size, one line per decoder (colour) and threshold (line style,
    marker), one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    thresholds = sorted({r["threshold"] for r in rows}, reverse=True)
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "v")]
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        lines = {}
        for r in rows:
            if r["model"] == model:
                lines.setdefault((r["decoder"], r["threshold"]), []).append(r)
        for (decoder, threshold), line in lines.items():
            style, marker = styles[thresholds.index(threshold) % len(styles)]
            mars = decoder in MARS
            ax.plot(
                [r["batch"] for r in line],
                [r["speedup"] for r in line],
                color=f"C{DECODERS.index(decoder)}",
                linestyle=style,
                marker=marker,
                label=f"{decoder} t={threshold:g}" if mars else decoder,
            )
        ax.set(xlabel="batch size", ylabel="speedup over ar (tokens/s)", title=model)
        ax.set_xscale("log", base=2)
        batches = sorted({r["batch"] for r in rows if r["model"] == model})
        ax.set_xticks(batches, [str(b) for b in batches], minor=False)
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(rows: Sequence[dict], output_dir: str, header: str = "") -> None:
    """decode_speed.md (``header`` then the table), .jsonl (one row a line) and .png (`plot`)."""
    decode_step.write_results(output_dir, "decode_speed", rows, header + markdown(rows))
    plot(rows, os.path.join(output_dir, "decode_speed.png"))


def main() -> None:
    config = cli.config_flag(help="Config of the trained run (its eval data gives the prompts).")
    workdir = flags.DEFINE_string(
        "workdir", None, "Trained run or Hugging Face directory (--model=trained)."
    )
    block_size = flags.DEFINE_integer(
        "block_size", None, "--model=trained: block size (default: the run's, or mars_block_size)."
    )
    models = flags.DEFINE_list(
        "model", ["both"], f"Models: both (trained, qwen0_5b_shape), or a list of {MODELS}."
    )
    decoders = flags.DEFINE_list("decoders", list(DECODERS), "Decoders (ar is always timed).")
    batch_sizes = flags.DEFINE_list("batch_sizes", ["1", "4", "16", "64"], "Batch sizes.")
    thresholds = flags.DEFINE_list("thresholds", ["1.0", "0.95", "0.9", "0.8"], "MARS thresholds.")
    num_prompts = flags.DEFINE_integer(
        "num_prompts", 64, "Trained model: prompts per configuration (whole batches)."
    )
    max_new = flags.DEFINE_integer("max_new_tokens", 128, "Trained model: completion budget.")
    shape_len = flags.DEFINE_integer("shape_prompt_len", 40, "*_shape: prompt tokens.")
    shape_new = flags.DEFINE_integer("shape_max_new_tokens", 16, "*_shape: new tokens.")
    shape_dtype = flags.DEFINE_string(
        "shape_dtype",
        "float32",
        "*_shape: parameter and compute dtype (transformers runs the same).",
    )
    repeats = flags.DEFINE_integer("repeats", 2, "Timed runs per configuration (best is kept).")
    as_json = flags.DEFINE_bool("json", False, "Print one JSON line per row, not a table.")
    output_dir = flags.DEFINE_string(
        "output_dir", "", "Write decode_speed.{md,jsonl,png} (decode_step.{md,jsonl}) here."
    )
    # Fixed acceptance (benchmarks/decode_step.py): --accept switches to the step table.
    accept = flags.DEFINE_list(
        "accept",
        [],
        "Fixed acceptance: time steps where every row accepts exactly K tokens per "
        "forward, for each K (benchmarks/decode_step.py; K > B is skipped).",
    )
    shapes = flags.DEFINE_list(
        "shapes", ["qwen0_5b"], "--accept: architectures (tiny, qwen0_5b, qwen7b), random weights."
    )
    dtypes = flags.DEFINE_list("dtypes", ["float32"], "--accept: dtypes (float32, bfloat16).")
    block_sizes = flags.DEFINE_list("block_sizes", ["4", "8"], "--accept: block sizes B.")
    modes = flags.DEFINE_list("modes", list(decode_step.MODES), "--accept: modes.")
    prompt_len = flags.DEFINE_integer("prompt_len", 128, "--accept: prompt tokens per row.")
    steps = flags.DEFINE_integer("steps", 8, "--accept: forwards per timed program.")
    parts = flags.DEFINE_bool(
        "parts",
        False,
        "With --accept: also time a step's pieces alone "
        "(layers, projection, choice; benchmarks/decode_step.parts).",
    )
    profile_dir = flags.DEFINE_string("profile_dir", "", "--parts: write jax.profiler traces.")

    def save(rows):  # after every group, so that a run stopped early keeps what it measured
        header = (
            f"{decode_step.device_line()}; fixed acceptance, {steps.value} forwards per "
            f"program, best of {repeats.value}, prompts of {prompt_len.value} tokens.\n\n"
        )
        if output_dir.value:
            decode_step.write(rows, output_dir.value, header)

    def run_steps():
        rows = decode_step.benchmark(
            shapes=shapes.value,
            dtypes=dtypes.value,
            batch_sizes=[int(b) for b in batch_sizes.value],
            block_sizes=[int(b) for b in block_sizes.value],
            accepts=[int(k) for k in accept.value],
            modes=modes.value,
            prompt_len=prompt_len.value,
            steps=steps.value,
            repeats=repeats.value,
            emit=lambda text: print(text, flush=True),
            on_rows=save,
        )
        if as_json.value:
            print("\n".join(json.dumps(r) for r in rows))
        if parts.value:
            pieces = [
                p
                for shape in shapes.value
                for dtype in dtypes.value
                for b in batch_sizes.value
                for p in decode_step.parts(
                    shape,
                    dtype,
                    batch=int(b),
                    block_size=int(block_sizes.value[0]),
                    prompt_len=prompt_len.value,
                    repeats=repeats.value,
                    profile_dir=profile_dir.value,
                )
            ]
            print(decode_step.parts_markdown(pieces))
            if output_dir.value:
                with open(os.path.join(output_dir.value, "decode_step_parts.md"), "w") as f:
                    f.write(decode_step.parts_markdown(pieces))

    def run():
        if accept.value:
            return run_steps()
        # The trained run's eval data gives the prompts; its paths are checked where read.
        config_lib.validate(config.value, training=False, paths=False)
        import torch

        names = ["trained", "qwen0_5b_shape"] if models.value == ["both"] else models.value
        unknown = set(decoders.value) - set(DECODERS)
        if unknown:
            raise ValueError(f"unknown decoders {sorted(unknown)}; expected some of {DECODERS}")
        sizes = [int(b) for b in batch_sizes.value]
        subjects = build_subjects(
            names,
            batch_sizes=sizes,
            workdir=workdir.value,
            config=config.value,
            block_size=block_size.value,
            num_prompts=num_prompts.value,
            max_new_tokens=max_new.value,
            shape_prompt_len=shape_len.value,
            shape_max_new_tokens=shape_new.value,
            shape_dtype=shape_dtype.value,
        )
        header = (
            f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; transformers on torch "
            f"{torch.__version__} with {torch.get_num_threads()} threads; best of "
            f"{repeats.value}. "
            + " ".join(
                f"{s.name}: block size {s.block_size}, max_new_tokens "
                f"{s.max_new_tokens}, EOS {list(s.eos_ids) or 'none'}."
                for s in subjects
            )
            + "\n\n"
        )
        common.progress("models ready")

        def save_rows(rows):  # after every batch size: a run cut short keeps those
            if output_dir.value:
                write(rows, output_dir.value, header)

        rows = benchmark(
            subjects,
            batch_sizes=sizes,
            thresholds=[float(t) for t in thresholds.value],
            decoders=decoders.value,
            repeats=repeats.value,
            on_rows=save_rows,
        )
        print("\n".join(json.dumps(r) for r in rows) if as_json.value else header + markdown(rows))

    cli.run(run)


if __name__ == "__main__":
    main()
