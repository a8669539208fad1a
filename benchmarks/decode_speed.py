r"""Wall-clock decoding speed: MARS threshold decoding vs AR decoding with a KV cache.

  PYTHONPATH=. python benchmarks/decode_speed.py --config=configs/gsm8k_tiny.py --workdir=runs/gsm8k_tiny/mars

For each batch size, decodes the same evaluation prompts with (1) the AR baseline: block_size 1,
threshold 1.0, i.e. one token per forward over a one-token window with the KV cache, and (2)
MARS at each threshold with the run's block size, all in one process, side by side. Reports
tokens per forward, generated tokens/s (EOS included) and the speedup over the AR baseline.
Each configuration is compiled and run once before it is timed; the best of ``--repeats`` runs
is reported. The paper (Sec. 5) reports 1.71x at batch 4 and 1.34x at batch 16 for Qwen2.5-7B.
"""

from __future__ import annotations

import json
import time

from absl import flags

from mars_jax import cli, data, decode, workdir as wd


def _time(model, prompts, *, batch: int, block_size: int, threshold: float, max_new_tokens: int,
          repeats: int, pad_id: int) -> dict:
    """Best wall-clock of ``repeats`` decodes of ``prompts`` (after one compiling run)."""

    def run():
        return decode.generate_batched(
            model,
            prompts,
            batch_size=batch,
            pad_id=pad_id,
            block_size=block_size,
            threshold=threshold,
            max_new_tokens=max_new_tokens,
        )

    run()  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - start)
    return {"tokens_per_forward": out.tokens_per_forward, "tokens_per_s": float(out.accepted.sum() / best)}


def benchmark(cfg, workdir: str, *, batch_sizes, thresholds, num_prompts: int,
              max_new_tokens: int, repeats: int) -> list[dict]:
    """Prints the side-by-side table (module docstring) and returns its rows."""
    model, tok, step = wd.load_model(workdir)
    source, fmt, seed = data.eval_source(cfg)
    examples = data.eval_examples(source, num_examples=num_prompts, fmt=fmt, seed=seed)
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m, _ in examples]
    block_size = wd.trained_block_size(workdir)
    timing = dict(max_new_tokens=max_new_tokens, repeats=repeats, pad_id=tok.pad_id)
    print(
        f"{workdir} step {step}: {len(prompts)} prompts, max_new_tokens "
        f"{max_new_tokens}, MARS block_size {block_size}"
    )
    print("| batch | decoder | threshold | tokens/forward | tokens/s | speedup vs AR |")
    print("|---|---|---|---|---|---|")
    rows = []
    for batch in batch_sizes:
        base = _time(model, prompts, batch=batch, block_size=1, threshold=1.0, **timing)
        rows.append({"batch": batch, "decoder": "ar", "threshold": 1.0, **base})
        print(
            f"| {batch} | AR (KV cache) | 1.00 | {base['tokens_per_forward']:.2f} | "
            f"{base['tokens_per_s']:.1f} | 1.00x |"
        )
        for threshold in thresholds:
            r = _time(
                model, prompts, batch=batch, block_size=block_size, threshold=threshold, **timing
            )
            rows.append({"batch": batch, "decoder": "mars", "threshold": threshold, **r})
            print(
                f"| {batch} | MARS B={block_size} | {threshold:.2f} | "
                f"{r['tokens_per_forward']:.2f} | {r['tokens_per_s']:.1f} | "
                f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x |"
            )
    return rows


def main() -> None:
    config = cli.config_flag(help="Run config (eval data).")
    workdir = cli.workdir_flag("Trained MARS run directory.")
    batch_sizes = flags.DEFINE_list("batch_sizes", ["4", "16"], "Batch sizes to time.")
    thresholds = flags.DEFINE_list("thresholds", ["1.0", "0.95", "0.9", "0.8"], "MARS thresholds.")
    num_prompts = flags.DEFINE_integer("num_prompts", 32, "Prompts decoded per configuration.")
    max_new = flags.DEFINE_integer("max_new_tokens", 128, "Completion budget.")
    repeats = flags.DEFINE_integer("repeats", 2, "Timed runs per configuration (best is kept).")

    def run():
        rows = benchmark(
            config.value,
            workdir.value,
            batch_sizes=[int(b) for b in batch_sizes.value],
            thresholds=[float(t) for t in thresholds.value],
            num_prompts=num_prompts.value,
            max_new_tokens=max_new.value,
            repeats=repeats.value,
        )
        print(json.dumps(rows))

    cli.run(run)


if __name__ == "__main__":
    main()
