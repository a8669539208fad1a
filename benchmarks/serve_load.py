r"""Serving under load: Poisson arrivals of chat requests against the live server on 127.0.0.1,
continuous batching against static batching (the same engine, a batch refilled only once empty)
against AR (continuous, threshold 1.0).

  PYTHONPATH=. python benchmarks/serve_load.py --workdir=runs/synthetic/mars \
      --requests=64 --rate=2 --max_seconds=600 --output_dir=benchmarks/results/serve_load
  PYTHONPATH=. python benchmarks/serve_load.py --model=tiny --requests=6 --rate=20 \
      --max_seconds=30 --min_tokens=2 --max_tokens=6 --output_dir=/tmp/serve_load

Prompts: GSM8K test questions (``--prompts``, default ../shared/data/gsm8k/test.jsonl) where
the file exists and the run's tokenizer encodes them (a trimmed run may not), else the built-in
arithmetic problems. Request i arrives at the i-th point of
a Poisson process of ``--rate`` requests per second (seeded: every mode sees the same arrivals,
prompts and budgets), asks for a budget drawn uniformly from ``--min_tokens``..``--max_tokens``
(mixed output lengths), greedy, streamed. A mode stops sending at ``--max_seconds`` and waits
as long again for the requests in flight. Each mode gets a fresh server (compiled and warmed up
with one request first), all modes in one process on the same weights, so only their ratios
mean anything. ``--model=tiny`` serves random weights of configs/tiny.py's shape (a smoke
check of the machinery: its acceptance means nothing).

Per mode: completed requests, throughput (completion tokens per second from the first arrival
to the last completion), p50 / p99 latency and time to first token, and tokens per forward.
Writes serve_load.md (the table) and serve_load.jsonl (one row per mode) to ``--output_dir``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time

import aiohttp
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mars_jax import engine, serve, sources, vocab  # noqa: E402
from mars_jax.decode_options import DecodeOptions  # noqa: E402
from mars_jax.rows import read_rows  # noqa: E402
from mars_jax.synthetic import arithmetic_problems  # noqa: E402
from mars_jax.tokenizer import load_tokenizer  # noqa: E402

MODES = ("continuous", "static", "ar")
FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_enum("model", "trained", ["trained", "tiny"], "A trained run or tiny random.")
    flags.DEFINE_string("workdir", None, "The run or HF directory served (--model=trained).")
    flags.DEFINE_integer("block_size", None, "Block size (default: the run's or config.json's).")
    flags.DEFINE_string("prompts", "../shared/data/gsm8k/test.jsonl", "GSM8K-style JSONL.")
    flags.DEFINE_integer("requests", 64, "Requests per mode.")
    flags.DEFINE_float("rate", 2.0, "Mean arrivals per second (Poisson).")
    flags.DEFINE_float("max_seconds", 600.0, "Stop sending after this long (per mode).")
    flags.DEFINE_integer("min_tokens", 16, "Smallest budget of a request.")
    flags.DEFINE_integer("max_tokens", 256, "Largest budget of a request.")
    flags.DEFINE_integer("slots", 8, "Slots of the engine.")
    flags.DEFINE_integer("max_prompt_len", 256, "Prompt width of the engine.")
    flags.DEFINE_integer("steps_per_call", 4, "Forwards per device call.")
    flags.DEFINE_integer("prefill_chunk", 128, "Prompt tokens per prefill forward.")
    flags.DEFINE_float("threshold", 0.9, "MARS threshold (continuous and static modes).")
    flags.DEFINE_list("modes", list(MODES), f"Modes among {MODES}.")
    flags.DEFINE_integer("seed", 0, "Seed of arrivals, prompts and budgets.")
    flags.DEFINE_string("output_dir", None, "Where serve_load.md and .jsonl go.")


def load_model():
    if FLAGS.model == "trained":
        if not FLAGS.workdir:
            raise app.UsageError("--model=trained needs --workdir")
        opened = sources.open(FLAGS.workdir, block_size=FLAGS.block_size)
        name = os.path.basename(os.path.normpath(FLAGS.workdir))
        return opened.model, opened.tokenizer, opened.block_size, name
    from flax import nnx

    from mars_jax import config as config_lib
    from mars_jax.model import CausalLM, ModelConfig

    cfg = config_lib.defaults("mars")  # configs/tiny.py
    model = CausalLM(ModelConfig(**cfg.model), rngs=nnx.Rngs(0))
    return model, load_tokenizer(None), int(cfg.objective.block_size), "tiny"


def servable(tok, questions):
    """The questions whose chat prompt the run's tokenizer encodes (a trimmed run lacks most
    tokens of other data) within --max_prompt_len tokens."""
    out = []
    for q in questions:
        try:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], True)
        except ValueError:
            continue
        if len(ids) <= FLAGS.max_prompt_len:
            out.append(q)
    return out


def workload(tok, n: int, seed: int):
    """(arrival seconds, question, budget) of n requests."""
    questions = []
    if os.path.isfile(FLAGS.prompts):
        questions = servable(tok, [r["question"] for r in read_rows(FLAGS.prompts)][:2000])
    if not questions:  # no file, or a run trained on other data: the built-in problems
        questions = servable(tok, [p["question"] for p in arithmetic_problems(max(n, 64), seed)])
    rng = random.Random(seed)
    arrivals = np.cumsum([rng.expovariate(FLAGS.rate) for _ in range(n)])
    return [
        (float(t), rng.choice(questions), rng.randint(FLAGS.min_tokens, FLAGS.max_tokens))
        for t in arrivals
    ]


async def one(session, url, question, budget, threshold, t0, arrival):
    await asyncio.sleep(max(0.0, t0 + arrival - time.monotonic()))
    sent = time.monotonic()
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": budget,
        "threshold": threshold,
        "stream": True,
    }
    first = usage = None
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"][0]["delta"].get("content"):
                first = time.monotonic()
            usage = chunk.get("usage") or usage
    done = time.monotonic()
    return {
        "sent": sent,
        "ttft": (first or done) - sent,
        "latency": done - sent,
        "done": done,
        "tokens": usage["completion_tokens"],
        "forwards": usage["completion_tokens"] / max(usage["tokens_per_forward"], 1e-9),
    }


async def drive(url, work, threshold):
    timeout = aiohttp.ClientTimeout(total=2 * FLAGS.max_seconds + 60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await one(session, url, work[0][1], 2, threshold, time.monotonic(), 0.0)  # warm-up
        t0 = time.monotonic()
        tasks = [
            asyncio.create_task(one(session, url, q, b, threshold, t0, t))
            for t, q, b in work
            if t <= FLAGS.max_seconds
        ]
        done, pending = await asyncio.wait(tasks, timeout=2 * FLAGS.max_seconds)
        for task in pending:
            task.cancel()
        return t0, [t.result() for t in done if t.exception() is None]


def run_mode(mode, model, tok, block_size, name, work):
    options = DecodeOptions(
        block_size=block_size, threshold=FLAGS.threshold, max_new_tokens=FLAGS.max_tokens
    )
    eng = engine.Engine(
        model,
        options,
        slots=FLAGS.slots,
        max_prompt_len=FLAGS.max_prompt_len,
        eos_ids=vocab.stop_ids(tok),
        mask_id=tok.mask_id,
        pad_id=tok.pad_id,
        steps_per_call=FLAGS.steps_per_call,
        prefill_chunk=FLAGS.prefill_chunk,
        sampling=False,
        refill=mode != "static",
    )
    eng.warmup()
    eng.start()
    server = serve.Server(eng, tok, model_name=name, max_waiting=10**6)
    background = serve.Background(serve.build_app(server))
    threshold = 1.0 if mode == "ar" else FLAGS.threshold
    forwards0 = eng.forwards
    try:
        t0, results = asyncio.run(drive(background.url, work, threshold))
    finally:
        background.close()
        eng.stop()
    end = max((r["done"] for r in results), default=t0)
    tokens = sum(r["tokens"] for r in results)
    pct = lambda key, q: float(np.percentile([r[key] for r in results], q)) if results else 0.0  # noqa: E731
    return {
        "mode": mode,
        "threshold": threshold,
        "requests": len(results),
        "sent": sum(1 for t, _, _ in work if t <= FLAGS.max_seconds),
        "seconds": end - t0,
        "tokens_per_s": tokens / max(end - t0, 1e-9),
        "p50_latency_s": pct("latency", 50),
        "p99_latency_s": pct("latency", 99),
        "p50_ttft_s": pct("ttft", 50),
        "p99_ttft_s": pct("ttft", 99),
        "tokens_per_forward": tokens / max(sum(r["forwards"] for r in results), 1e-9),
        "batch_forwards": eng.forwards - forwards0,
    }


def table(rows) -> str:
    base = {r["mode"]: r["tokens_per_s"] for r in rows}
    lines = [
        "| mode | threshold | requests | tokens/s | vs static | vs ar | p50 latency s | "
        "p99 latency s | p50 TTFT s | p99 TTFT s | tokens/forward |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = lambda m: f"{r['tokens_per_s'] / base[m]:.2f}x" if base.get(m) else "-"  # noqa: E731
        lines.append(
            f"| {r['mode']} | {r['threshold']:.2f} | {r['requests']}/{r['sent']} | "
            f"{r['tokens_per_s']:.1f} | {ratio('static')} | {ratio('ar')} | "
            f"{r['p50_latency_s']:.2f} | {r['p99_latency_s']:.2f} | {r['p50_ttft_s']:.2f} | "
            f"{r['p99_ttft_s']:.2f} | {r['tokens_per_forward']:.2f} |"
        )
    return "\n".join(lines)


def main(argv):
    del argv
    for mode in FLAGS.modes:
        if mode not in MODES:
            raise app.UsageError(f"--modes: {mode!r} is none of {MODES}")
    model, tok, block_size, name = load_model()
    work = workload(tok, FLAGS.requests, FLAGS.seed)
    rows = [run_mode(m, model, tok, block_size, name, work) for m in FLAGS.modes]
    text = (
        f"{name}: {FLAGS.requests} requests at {FLAGS.rate}/s (Poisson), budgets "
        f"{FLAGS.min_tokens}-{FLAGS.max_tokens}, {FLAGS.slots} slots, block size {block_size}\n\n"
        + table(rows)
    )
    print(text)
    if FLAGS.output_dir:
        os.makedirs(FLAGS.output_dir, exist_ok=True)
        with open(os.path.join(FLAGS.output_dir, "serve_load.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(FLAGS.output_dir, "serve_load.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    define_flags()
    app.run(main)
