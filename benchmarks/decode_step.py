r"""Decode-step cost at fixed acceptance: what a MARS step costs against an AR step, per mode.

  PYTHONPATH=. python benchmarks/decode_speed.py --accept=1,2,4,8 --shapes=qwen0_5b \
      --dtypes=float32 --batch_sizes=1 --block_sizes=8 [--output_dir=DIR]

(`benchmarks/decode_speed.py --accept=...` runs this module's `main`.)

A checkpoint's acceptance and the decoder's efficiency are separate questions; this benchmark
answers the second. Every row of a batch is made to accept exactly K tokens per forward: the
decoder gets ``max_accept = K`` and a threshold (1e-30) that the ``prob`` rule always meets,
and no EOS, on random weights of a real architecture (``--shapes``: configs/qwen0_5b.py,
configs/qwen7b.py, or ``tiny`` for smoke runs), in ``--dtypes`` (parameters, compute and KV
cache in that dtype). Prompts are ``--prompt_len`` random tokens.

Per (shape, dtype, batch, B) one program per mode is compiled, `mars_jax.decoder.Decoder.steps`:
``--steps`` forwards in one jitted ``while_loop`` (no host round trip between forwards, as in
`decode.generate`), its state donated; then every (mode, K) runs once untimed and ``--repeats``
rounds time each in turn, best kept (a busy machine favours none). Modes:

  ar             block_size 1: one token per forward over a one-token window (the baseline);
  sliding        per-row cursors, adaptive window: B slots while every row has one uncached
                 token (K = 1), else 2B-1;
  sliding_fixed  the window always 2B-1 slots;
  block          the reference's block cache: fills of B slots, each accepting K (capped at the
                 block's end), then one commit forward per block.

Columns: step_ms (wall ms per forward), ar_step_ms (ar at the same shape, dtype and batch),
conversion = ar_step_ms / step_ms (1.0: a MARS step costs one AR step), tokens_per_forward
(counted in the timed run: K for sliding, B / (ceil(B / K) + 1) for block) and speedup =
tokens_per_forward * conversion, the tokens/s over AR this decoder would reach at that
acceptance; param_bytes, the parameters' bytes (a step's floor is param_bytes / the memory
bandwidth: on an H200, 4.8 TB/s).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common
from mars_jax import acceptance
from mars_jax.decode_state import DecoderSettings, DecodeState, RowSettings
from mars_jax.decoder import Decoder
from mars_jax.model import ModelConfig
from mars_jax.tokenizer import ENDOFTEXT_ID, MASK_ID

MODES = ("ar", "sliding", "sliding_fixed", "block")
SHAPES = ("tiny", "qwen0_5b", "qwen7b")
ACCEPT_ALL = 1e-30  # below any probability the prob rule computes: every candidate qualifies
KEYS = (
    "shape",
    "dtype",
    "batch",
    "block_size",
    "mode",
    "accept",
    "prompt_len",
    "steps",
    "step_ms",
    "ar_step_ms",
    "conversion",
    "tokens_per_forward",
    "speedup",
    "param_bytes",
)


def model_config(shape: str, dtype: str, **overrides) -> ModelConfig:
    """The architecture of configs/``shape``.py (``tiny``, ``qwen0_5b``, ``qwen7b``) with
    parameters and compute in ``dtype``; ``overrides`` are other `ModelConfig` fields."""
    import importlib

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    c = importlib.import_module(f"configs.{shape}").get_config("mars")
    return ModelConfig(**{**c.model.to_dict(), "dtype": dtype, "param_dtype": dtype, **overrides})


def make_decoder(
    graphdef, *, block_size: int, mode: str, max_new_tokens: int, mesh=None, axis_rules=None
) -> Decoder:
    """The `Decoder` of ``mode`` (`MODES`; ``ar`` is block size 1), with no EOS."""
    return Decoder(
        graphdef,
        DecoderSettings(
            block_size=1 if mode == "ar" else block_size,
            max_new_tokens=max_new_tokens,
            eos_ids=(),
            mask_id=MASK_ID,
            sampling=False,
            cache_mode="block" if mode == "block" else "sliding",
            rule="prob",
            adaptive_window=mode != "sliding_fixed",
            mesh=mesh,
            axis_rules=axis_rules,
            on_accept=None,
        ),
    )


def prefill(
    decoder: Decoder, params, *, rows: int, prompt_len: int, accept: int, seed: int = 0
) -> DecodeState:
    """The state after prefilling ``rows`` random prompts of ``prompt_len`` tokens, each row
    accepting exactly ``accept`` tokens per forward from then on."""
    ids = np.random.default_rng(seed).integers(0, ENDOFTEXT_ID, (rows, prompt_len))
    return decoder.prefill(
        params,
        jnp.asarray(ids, jnp.int32),
        jnp.full((rows,), prompt_len, jnp.int32),
        RowSettings.build(
            rows,
            threshold=ACCEPT_ALL,
            max_accept=accept,
            max_new_tokens=decoder.settings.max_new_tokens,
            seed=seed,
        ),
    )


@dataclasses.dataclass
class Case:
    """One (mode, K) of a (shape, dtype, batch, B) group: its decoder and live state."""

    mode: str
    accept: int
    decoder: Decoder
    state: DecodeState
    best: float = math.inf
    tokens_per_forward: float = 0.0

    def run(self, params, steps: int) -> float:
        """Runs ``steps`` forwards; returns their wall seconds and records tokens/forward."""
        before = jax.device_get((self.state.new_tokens, self.state.row_forwards))
        start = time.perf_counter()
        self.state = self.decoder.steps(params, self.state, steps)
        after = jax.device_get((self.state.new_tokens, self.state.row_forwards))
        seconds = time.perf_counter() - start
        if bool(jnp.any(self.state.done)):
            raise RuntimeError(f"{self.mode}: a row finished inside the timed forwards")
        self.tokens_per_forward = float(
            (after[0] - before[0]).sum() / max((after[1] - before[1]).sum(), 1)
        )
        return seconds


def benchmark_group(
    graphdef,
    params,
    *,
    shape: str,
    dtype: str,
    batch: int,
    block_size: int,
    accepts: Sequence[int],
    modes: Sequence[str],
    prompt_len: int,
    steps: int,
    repeats: int,
    budget_block: int | None = None,
) -> list[dict]:
    """Every (mode, K) row of one (shape, dtype, batch, B) group, ar included (`KEYS`).
    The completion budget, never reached, is sized for K up to ``budget_block`` (default B):
    groups of one batch size that share it share their AR program."""
    accepts = [k for k in accepts if 1 <= k <= block_size]
    budget = ((repeats + 1) * steps + 1) * (budget_block or block_size)
    cases = [Case("ar", 1, None, None)] + [
        Case(m, k, None, None) for m in modes if m != "ar" for k in accepts
    ]
    decoders = {}
    for case in cases:
        if case.mode not in decoders:
            decoders[case.mode] = make_decoder(
                graphdef, block_size=block_size, mode=case.mode, max_new_tokens=budget
            )
        case.decoder = decoders[case.mode]
        case.state = prefill(
            case.decoder, params, rows=batch, prompt_len=prompt_len, accept=case.accept
        )
        case.run(params, steps)  # compiles (once per mode), warms up
    common.progress(f"{shape} batch {batch} B {block_size}: compiled and warmed up")
    for _ in range(repeats):
        for case in cases:
            case.best = min(case.best, case.run(params, steps))
    ar_ms = 1e3 * cases[0].best / steps
    rows = []
    for case in cases:
        step_ms = 1e3 * case.best / steps
        conversion = ar_ms / step_ms
        rows.append(
            dict(
                shape=shape,
                dtype=dtype,
                batch=batch,
                block_size=case.decoder.settings.block_size,
                mode=case.mode,
                accept=case.accept,
                prompt_len=prompt_len,
                steps=steps,
                step_ms=step_ms,
                ar_step_ms=ar_ms,
                conversion=conversion,
                tokens_per_forward=case.tokens_per_forward,
                speedup=case.tokens_per_forward * conversion,
            )
        )
    return rows


def benchmark(
    *,
    shapes: Sequence[str],
    dtypes: Sequence[str],
    batch_sizes: Sequence[int],
    block_sizes: Sequence[int],
    accepts: Sequence[int],
    modes: Sequence[str] = MODES,
    prompt_len: int = 128,
    steps: int = 8,
    repeats: int = 3,
    emit=print,
    on_rows=None,
) -> list[dict]:
    """All rows, group by group: ``emit`` gets each group's markdown lines as they finish and
    ``on_rows`` (if given) every row so far."""
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}; expected some of {MODES}")
    rows = []
    for shape in shapes:
        for dtype in dtypes:
            cfg = model_config(shape, dtype)
            graphdef, params = jax.block_until_ready(common.random_params(cfg))
            common.progress(f"{shape} {dtype}: random parameters ready")
            for batch in batch_sizes:
                for b in block_sizes:
                    group = benchmark_group(
                        graphdef,
                        params,
                        shape=shape,
                        dtype=dtype,
                        batch=batch,
                        block_size=b,
                        accepts=accepts,
                        modes=modes,
                        prompt_len=prompt_len,
                        steps=steps,
                        repeats=repeats,
                        budget_block=max(block_sizes),
                    )
                    weights = sum(x.nbytes for x in jax.tree.leaves(params))
                    for r in group:  # a step's floor is weights / HBM bandwidth
                        r["param_bytes"] = weights
                    rows += group
                    common.progress(f"{shape} batch {batch} B {b}: timed")
                    emit(markdown(group, header=not rows[: -len(group)]).rstrip("\n"))
                    if on_rows is not None:
                        on_rows(rows)
            del params
    return rows


def markdown(rows: Sequence[dict], header: bool = True) -> str:
    """The rows as a markdown table (``header``: with its title lines)."""
    lines = (
        [
            "| shape | dtype | batch | B | mode | K | step ms | AR step ms | conversion | "
            "tokens/forward | speedup |",
            "|---" * 11 + "|",
        ]
        if header
        else []
    )
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['batch']} | {r['block_size']} | {r['mode']} | "
            f"{r['accept']} | {r['step_ms']:.2f} | {r['ar_step_ms']:.2f} | "
            f"{r['conversion']:.2f} | {r['tokens_per_forward']:.2f} | {r['speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def write_results(output_dir: str, name: str, rows: Sequence[dict], text: str) -> None:
    """``output_dir``/NAME.md (``text``) and NAME.jsonl (one row a line); the directory is made
    if missing. Every benchmark's results are written this way."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(output_dir, f"{name}.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def write(rows: Sequence[dict], output_dir: str, header: str = "") -> None:
    """decode_step.md (``header`` then the table) and decode_step.jsonl under ``output_dir``."""
    write_results(output_dir, "decode_step", rows, header + markdown(rows))


def device_line() -> str:
    """'JAX <version> on <device kind> (<platform>) x <devices>', the tables' header."""
    d = jax.devices()[0]
    return f"JAX {jax.__version__} on {d.device_kind} ({d.platform}) x {jax.device_count()}"


def parts(
    shape: str,
    dtype: str,
    *,
    batch: int,
    block_size: int,
    prompt_len: int,
    repeats: int = 5,
    profile_dir: str = "",
) -> list[dict]:
    """Where a step's time goes: the pieces of a sliding step timed alone (each a jitted
    program, best of ``repeats``) at T = 1 (AR), B (narrow) and 2B-1 (wide) query slots:
    ``layers`` (the decoder forward against the KV cache), ``projection`` (T positions onto the
    vocabulary) and ``choice`` (argmax and the prob confidence of those logits). With
    ``profile_dir``, a jax.profiler trace of one AR step and one narrow step is written there.
    """
    from mars_jax.kv_cache import init_cache

    cfg = model_config(shape, dtype)
    graphdef, params = common.random_params(cfg)
    slots = prompt_len + 2 * (2 * block_size - 1)
    cache = init_cache(cfg, batch, slots)
    start = jnp.full((batch,), prompt_len, jnp.int32)

    @jax.jit
    def layers(params, cache, ids):
        model = nnx.merge(graphdef, params)
        pos = start[:, None] + jnp.arange(ids.shape[1])
        return model(ids, pos, None, cache, start)

    @jax.jit
    def projection(params, hidden):
        return nnx.merge(graphdef, params).logits(hidden)

    @jax.jit
    def choice(logits):
        token = acceptance.argmax(logits)
        return token, acceptance.ACCEPTANCE_RULES["prob"].confidence(logits, token)

    def best(fn, *args):
        jax.block_until_ready(fn(*args))
        out = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            out = min(out, time.perf_counter() - t)
        return 1e3 * out

    rows = []
    for width in (1, block_size, 2 * block_size - 1):
        ids = jnp.zeros((batch, width), jnp.int32)
        hidden = jnp.ones((batch, min(width, block_size), cfg.hidden_size), cfg.dtype)
        logits = projection(params, hidden)
        rows.append(
            dict(
                shape=shape,
                dtype=dtype,
                batch=batch,
                slots=width,
                projected=hidden.shape[1],
                layers_ms=best(layers, params, cache, ids),
                projection_ms=best(projection, params, hidden),
                choice_ms=best(choice, logits),
            )
        )
    if profile_dir:
        for width in (1, block_size):
            with jax.profiler.trace(os.path.join(profile_dir, f"slots_{width}")):
                ids = jnp.zeros((batch, width), jnp.int32)
                hidden = layers(params, cache, ids)[0][:, :block_size]
                jax.block_until_ready(choice(projection(params, hidden)))
    return rows


def parts_markdown(rows: Sequence[dict]) -> str:
    """`parts`' rows as a markdown table; "x AR" is each row's summed ms over the first's."""
    lines = [
        "| shape | dtype | batch | query slots | projected | layers ms | projection ms | "
        "choice ms | total ms | x AR |",
        "|---" * 10 + "|",
    ]
    ar = rows[0]["layers_ms"] + rows[0]["projection_ms"] + rows[0]["choice_ms"]
    for r in rows:
        total = r["layers_ms"] + r["projection_ms"] + r["choice_ms"]
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['batch']} | {r['slots']} | "
            f"{r['projected']} | {r['layers_ms']:.1f} | {r['projection_ms']:.1f} | "
            f"{r['choice_ms']:.2f} | {total:.1f} | {total / ar:.2f} |"
        )
    return "\n".join(lines) + "\n"
