r"""One user: the same prompts through `generate` and through the server, one at a time.

  PYTHONPATH=. python benchmarks/serve_one_user.py --workdir=models/smollm2 \
      --num_prompts=8 --passes=2 --max_new_tokens=128 --thresholds=1.0 --slots=1 \
      --max_prompt_len=256 --steps_per_call=8 --output_dir=benchmarks/results/serve_one_user

For each threshold, each prompt (a GSM8K test question, chat-templated) is decoded by
`generate.complete` alone and sent alone to a live server on 127.0.0.1 (chat completions,
greedy, ``max_tokens`` = ``--max_new_tokens``, not streamed) started with the server flags
given here (``--slots``, ``--max_prompt_len``, ``--steps_per_call``, ``--prefill_chunk``: the
one-user profile of docs/serving.md by default). A pair's order swaps from one pair to the
next; an untimed pass over the prompts compiles their shapes, then ``--passes`` passes are
timed. Tokens/s is completion tokens over the wall clock of the calls (the server's: request
sent to answer read, HTTP included); the ratio is generate's over the server's (1.0: as fast),
over all pairs and as the median of the pairs' own ratios (on a shared CPU one pair can be
off by 15%). Both in one process on the same weights, so only the ratios mean anything. Writes
serve_one_user.md and .json to ``--output_dir``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mars_jax import generate, serve, sources  # noqa: E402
from mars_jax.rows import read_rows  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("workdir", None, "The run or Hugging Face directory.", required=True)
    flags.DEFINE_integer("block_size", None, "Block size (default: the run's or config.json's).")
    flags.DEFINE_string("prompts", "../shared/data/gsm8k/test.jsonl", "GSM8K-style JSONL.")
    flags.DEFINE_integer("num_prompts", 8, "Prompts (each decoded 1 + --passes times).")
    flags.DEFINE_integer("passes", 2, "Timed passes over the prompts, after an untimed one.")
    flags.DEFINE_integer("max_new_tokens", 128, "Completion budget of every prompt.")
    flags.DEFINE_list("thresholds", ["1.0"], "Thresholds (1.0: AR).")
    flags.DEFINE_integer("slots", 1, "Server: --slots.")
    flags.DEFINE_integer("max_prompt_len", 256, "Server: --max_prompt_len.")
    flags.DEFINE_integer("steps_per_call", 8, "Server: forwards per device call.")
    flags.DEFINE_integer("prefill_chunk", None, "Server: --prefill_chunk (default: whole).")
    flags.DEFINE_integer("max_logprobs", 20, "Server: --max_logprobs (0: none computed).")
    flags.DEFINE_string("output_dir", None, "Where serve_one_user.md and .json go.")


def questions(path: str, count: int) -> list[str]:
    rows = read_rows(path)
    if len(rows) < count:
        raise ValueError(f"{path}: {len(rows)} rows; --num_prompts={count} asked for")
    return [r["question"] for r in rows[:count]]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=3600) as r:
        return json.loads(r.read())


def measure(opened, prompts: list[str], threshold: float) -> dict:
    """One threshold: generate's and the server's tokens/s over ``prompts``, each prompt
    decoded by one and then the other, the order swapping from pair to pair (so that a machine's
    drift falls on both alike); ``--passes`` timed passes after an untimed one."""
    options = opened.options(max_new_tokens=FLAGS.max_new_tokens, threshold=threshold)
    server = serve.make_server(
        opened,
        options,
        slots=FLAGS.slots,
        max_prompt_len=FLAGS.max_prompt_len,
        max_waiting=4,
        steps_per_call=FLAGS.steps_per_call,
        prefill_chunk=FLAGS.prefill_chunk,
        max_logprobs=FLAGS.max_logprobs or None,
    )
    running = serve.Background(serve.build_app(server))
    body = {"max_tokens": FLAGS.max_new_tokens, "temperature": 0, "threshold": threshold}

    def generated(p):
        start = time.perf_counter()
        out = generate.complete(opened, [p], options)[0]
        return out, time.perf_counter() - start

    def served(p):
        start = time.perf_counter()
        answer = post(running.url, {**body, "messages": [{"role": "user", "content": p}]})
        return answer, time.perf_counter() - start

    pairs = []  # (generate's output, its seconds, the server's answer, its seconds)
    try:
        # The first pass compiles each prompt's shapes, for both; the others are timed.
        for timed in [False] + [True] * FLAGS.passes:
            for i, p in enumerate(prompts):
                if (i + len(pairs)) % 2:
                    (answer, s_seconds), (out, g_seconds) = served(p), generated(p)
                else:
                    (out, g_seconds), (answer, s_seconds) = generated(p), served(p)
                if timed:
                    pairs.append((out, g_seconds, answer, s_seconds))
    finally:
        running.close()
        server.engine.stop()
    gen_tokens = sum(len(o["tokens"]) for o, *_ in pairs)
    served_tokens = sum(a["usage"]["completion_tokens"] for _, _, a, _ in pairs)
    same = sum(a["choices"][0]["message"]["content"] == o["text"] for o, _, a, _ in pairs)
    seconds, served_seconds = sum(p[1] for p in pairs), sum(p[3] for p in pairs)
    gen_rate, served_rate = gen_tokens / seconds, served_tokens / served_seconds
    # Per pair: generate's tokens/s over the server's (the same tokens when the text agrees).
    ratios = [
        (len(o["tokens"]) / g) / max(a["usage"]["completion_tokens"] / s, 1e-9)
        for o, g, a, s in pairs
    ]
    return {
        "threshold": threshold,
        "prompts": len(pairs),
        "generate_tokens": gen_tokens,
        "generate_tokens_per_s": gen_rate,
        "serve_tokens": served_tokens,
        "serve_tokens_per_s": served_rate,
        "generate_over_serve": gen_rate / served_rate,
        "pair_ratios": [round(r, 4) for r in ratios],
        "median_pair_ratio": float(np.median(ratios)),
        "same_text": same,
        "tokens_per_forward": gen_tokens
        / max(sum(len(o["tokens"]) / o["tokens_per_forward"] for o, *_ in pairs), 1e-9),
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| threshold | generate tokens/s | serve tokens/s | generate / serve "
        "| median of pairs | same text | tokens/forward |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['threshold']:.2f} | {r['generate_tokens_per_s']:.1f} | "
            f"{r['serve_tokens_per_s']:.1f} | {r['generate_over_serve']:.2f}x | "
            f"{r['median_pair_ratio']:.2f}x | "
            f"{r['same_text']} of {r['prompts']} | {r['tokens_per_forward']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(_) -> None:
    opened = sources.open(FLAGS.workdir, block_size=FLAGS.block_size)
    prompts = questions(FLAGS.prompts, FLAGS.num_prompts)
    rows = [measure(opened, prompts, float(t)) for t in FLAGS.thresholds]
    settings = {
        k: getattr(FLAGS, k)
        for k in ("workdir", "num_prompts", "passes", "max_new_tokens", "slots", "max_prompt_len")
    }
    settings |= {k: getattr(FLAGS, k) for k in ("steps_per_call", "prefill_chunk", "max_logprobs")}
    table = markdown(rows)
    print(json.dumps(settings))
    print(table, end="")
    if FLAGS.output_dir:
        os.makedirs(FLAGS.output_dir, exist_ok=True)
        with open(os.path.join(FLAGS.output_dir, "serve_one_user.md"), "w") as f:
            f.write(f"`{json.dumps(settings)}`\n\n{table}")
        with open(os.path.join(FLAGS.output_dir, "serve_one_user.json"), "w") as f:
            json.dump({"settings": settings, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
