"""Every benchmark script runs as its docstring (or the README) shows it, at its smallest setting,
in a subprocess from the repository root on CPU, and what it prints parses and is sane: so that
a documented command cannot break unseen.

Scripts run as commands elsewhere: benchmarks/decode_hlo.py (tests/decoding/test_decode_hlo.py) and
launch/memory_plan.py (tests/training/test_memory_plan.py), both compiling for TPU through libtpu.
tests/decoding/test_decode_speed.py tests decode_speed's functions in-process; here its command runs, on
the checkpoint of the soak run (a 2-step tiny training run); benchmarks/accelerator.sh --smoke
runs train_step.py, decode_speed.py's fixed-acceptance table (``--accept``) and its transformers
comparison on a random shape.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess

import pytest

from tests.helpers import ROOT, python_env, run_python, tiny_config

pytestmark = pytest.mark.subprocess

# Shrinks configs/tiny.py's model (its 151,936-row embedding stays: the scripts draw real ids).
SMALL_MODEL = [
    "--config.model.num_layers=1",
    "--config.model.hidden_size=32",
    "--config.model.intermediate_size=64",
    "--config.model.head_dim=8",
]


def run(*args: str, pythonpath: bool = True, timeout: int = 300) -> str:
    """``[PYTHONPATH=.] python ARGS`` in the repository root on CPU; its stdout (exit code 0)."""
    env = python_env(PYTHONPATH="." if pythonpath else None)
    return run_python(*args, env=env, timeout=timeout).stdout


def header_and_body(text: str, title_prefix: str) -> tuple[list[str], list[list[str]]]:
    """(header cells, body rows) of the first markdown table under the first line that starts
    with ``title_prefix`` (or that starts there, if ``title_prefix`` starts with "|")."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title_prefix))
    block = []
    for line in lines[start + (not title_prefix.startswith("|")) :]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            break
    assert len(block) >= 2 and all(set(c) <= set("-: ") for c in block[1]), block[:2]
    return block[0], block[2:]


def num(cell: str) -> float:
    return float(cell.replace(",", ""))


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# -- benchmarks/roofline.py ------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra", [[], ["--cpu_gflops=278", "--cpu_gbps=42.3"]], ids=["accelerators", "with_cpu"]
)
def test_roofline(extra):
    """docs/decoding.md's commands: the tables, with the published parameter counts."""
    out = run("benchmarks/roofline.py", "--markdown", *extra)
    hardware = ["TPU v5e", "H100 SXM", "H200"] + ["CPU (measured)"] * bool(extra)

    head, rows = header_and_body(out, "### Hardware")
    assert [r[0] for r in rows] == hardware
    for r in rows:
        cell = dict(zip(head, r))
        ridge = num(cell["peak TFLOP/s"]) * 1e3 / num(cell["bandwidth GB/s"])
        assert num(cell["ridge FLOP/byte"]) == pytest.approx(ridge, rel=0.01)

    head, rows = header_and_body(out, "### Models")
    models = {r[0]: dict(zip(head, r)) for r in rows}
    assert list(models) == ["Qwen2.5-0.5B", "Qwen2.5-7B"]
    # Qwen2.5-0.5B: 0.49B parameters, tied embeddings; Qwen2.5-7B: 7.61B, untied.
    assert num(models["Qwen2.5-0.5B"]["total"]) == 494_032_768
    assert num(models["Qwen2.5-7B"]["total"]) == 7_615_616_512
    for m in models.values():
        heads = 1 if m["tied"] == "True" else 2
        assert num(m["non-embedding"]) + heads * num(m["V x D"]) == num(m["total"])

    modes = [
        "AR (KV cache)",
        "sliding / verify (2B-1)",
        "sliding, adaptive (B)",
        "block (B)",
        "block commit (B, 1 projection)",
        "none (no cache)",
    ]
    for model in models:
        for hw in hardware:
            head, rows = header_and_body(out, f"### {model} on {hw}: step ms")
            assert head == ["mode", "R=1", "R=4", "R=16", "R=64"]
            assert [r[0] for r in rows] == modes
            for r in rows:
                for cell in r[1:]:
                    ms, bound, ratio = cell.split()
                    assert num(ms) > 0 and bound in ("M", "C") and ratio.startswith("x")
                    if r[0] == modes[0]:
                        assert ratio == "x1.00"
                    elif r[0] != modes[-1]:  # a window over the same cache costs >= AR's step
                        assert float(ratio[1:]) >= 1.0

    head, rows = header_and_body(out, "### Ridge")
    assert [(r[0], r[1]) for r in rows] == [(m, h) for m in models for h in hardware]
    for r in rows:
        ridges = [int(c) for c in r[2:]]
        assert ridges == sorted(ridges, reverse=True)  # a wider window fits fewer rows


# -- benchmarks/accelerator.sh --smoke: decode_step, transformers and train_step ----------


SMOKE_BLOCK, SMOKE_STEPS = 2, 6  # accelerator.sh --smoke's B and forwards per program


@pytest.fixture(scope="module")
def accelerator(tmp_path_factory):
    """The prepared accelerator run on CPU at its smoke setting: its output directory."""
    out = tmp_path_factory.mktemp("accelerator")
    proc = subprocess.run(
        ["bash", "benchmarks/accelerator.sh", "--smoke", str(out)],
        cwd=ROOT,
        env=python_env(PYTHONPATH=None),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_accelerator_parts(accelerator):
    parts = [json.loads(line) for line in (accelerator / "parts.jsonl").read_text().splitlines()]
    assert [p["part"] for p in parts] == [
        "decode_step_tiny",
        "transformers",
        "train_step",
        "train_packed_tiny",
    ]
    assert all(p["rc"] == 0 for p in parts)
    summary = (accelerator / "summary.md").read_text()
    for p in parts:
        assert f"## {p['part']}" in summary and p["command"] in summary
    # Each part logs its timeline as it goes: a part its limit cuts short still shows where
    # its time went (the first H200 run left four empty or header-only logs).
    for part, steps in {
        "decode_step_tiny": ["tiny float32: random parameters ready", "tiny batch 1 B 2: timed"],
        "transformers": ["models ready", "tiny_shape batch 1 sliding 0.5: compiled, ran"],
        "train_step": ["ar: parameters and optimizer state ready", "mars: compiled and ran"],
        "train_packed_tiny": ["256 packing=True ar: compiled", "256 packing=True mars: compiled"],
    }.items():
        log = (accelerator / f"{part}.log").read_text()
        times = [float(t) for t in re.findall(r"^\[ *(\d+\.\d) s\] ", log, re.M)]
        assert times == sorted(times) and len(times) >= len(steps), log
        for step in steps:
            assert re.search(rf"^\[ *\d+\.\d s\] {re.escape(step)}", log, re.M), (step, log)


@pytest.mark.slow
def test_train_step(accelerator):
    """benchmarks/train_step.py (the README's command) at one timed step of a shrunk tiny model
    with a vocabulary that is not Qwen's (4,096 rows: the ids and the mask drawn inside it; a
    Qwen id there gave a NaN loss) on a small batch and length; the peak measured with a small
    matmul."""
    rows, length = 2, 32
    out = (accelerator / "train_step.log").read_text()
    lines = [line for line in out.strip().splitlines() if not line.startswith(("W", "I"))]
    assert lines[0].startswith(f"cpu x 1: batch {rows}, length {length}, 50% labelled")
    ratio = re.fullmatch(r"mars/ar step time ratio: (\d+\.\d\d)", lines[-1])
    assert ratio, lines[-1]
    result = json.loads(lines[-2])
    assert [r["objective"] for r in result] == ["ar", "mars"]
    for r in result:
        assert finite_positive(r["step_s"]) and finite_positive(r["mfu"])
        assert r["tokens_per_s"] == pytest.approx(rows * length / r["step_s"])
    ar, mars = result
    # MARS runs the decoder over 2L tokens and two logits streams: more FLOPs than AR, not 4x.
    assert 1.5 < mars["tflop_per_step"] / ar["tflop_per_step"] < 2.5
    assert float(ratio.group(1)) == pytest.approx(mars["step_s"] / ar["step_s"], abs=0.006)
    head, body = header_and_body(out, "| objective")  # the table has no title line
    assert [r[0] for r in body] == ["ar", "mars"]


@pytest.mark.slow
def test_decode_step(accelerator):
    """decode_speed.py --accept (benchmarks/decode_step.py) on the tiny shape, B = 2, K = 1 and
    2. 6 forwards per program: a whole number of the block mode's cycles (ceil(B / K) fills and
    a commit: 3 and 2 forwards), so its tokens_per_forward is exactly B / (ceil(B / K) + 1)."""
    block, steps, out = SMOKE_BLOCK, SMOKE_STEPS, accelerator / "decode_step_tiny"
    rows = [json.loads(line) for line in (out / "decode_step.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["accept"]) for r in rows] == [("ar", 1)] + [
        (m, k) for m in ("sliding", "sliding_fixed", "block") for k in (1, 2)
    ]
    ar = rows[0]
    assert ar["block_size"] == 1 and ar["conversion"] == 1.0 and ar["tokens_per_forward"] == 1.0
    for r in rows:
        assert (r["shape"], r["dtype"], r["batch"], r["steps"]) == ("tiny", "float32", 1, steps)
        assert r["block_size"] == (1 if r["mode"] == "ar" else block)
        assert finite_positive(r["step_ms"]) and r["ar_step_ms"] == ar["step_ms"]
        assert r["conversion"] == pytest.approx(r["ar_step_ms"] / r["step_ms"])
        assert r["speedup"] == pytest.approx(r["tokens_per_forward"] * r["conversion"])
        k = r["accept"]
        expected = k if r["mode"] != "block" else block / (math.ceil(block / k) + 1)
        assert r["tokens_per_forward"] == pytest.approx(expected), r
    md = (out / "decode_step.md").read_text()
    assert md.startswith("JAX ") and f"{steps} forwards per program, best of 1" in md
    assert len(header_and_body(md, "JAX ")[1]) == len(rows)


@pytest.mark.slow
def test_transformers_beside_our_decoders(accelerator):
    rows = [
        json.loads(line)
        for line in (accelerator / "transformers" / "decode_speed.jsonl").read_text().splitlines()
    ]
    assert [r["decoder"] for r in rows] == ["ar", "sliding", "transformers"]
    ar = rows[0]
    for r in rows:
        assert r["model"] == "tiny_shape" and r["batch"] == 1 and r["max_new_tokens"] == 4
        # No EOS on a random model: every row generates the whole budget in every decoder.
        assert r["tokens"] == 4 * r["prompts"]
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / ar["tokens_per_s"])
        assert r["conversion"] == pytest.approx(r["speedup"] / r["tokens_per_forward"])


def test_random_params_repeat_one_layer_of_the_models_own_init():
    """`common.random_params` (what every benchmark's random model is): the model's own init
    of one layer, that layer's values on every layer, the other parameters as they are; shapes,
    dtypes and tree those of the whole model."""
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx

    from benchmarks import common
    from mars_jax.model import CausalLM, ModelConfig, abstract_model

    cfg = ModelConfig(**tiny_config().model)
    assert cfg.num_layers > 1
    graphdef, params = common.random_params(cfg, seed=3)
    _, abstract = nnx.split(abstract_model(cfg))
    _, one = nnx.split(CausalLM(dataclasses.replace(cfg, num_layers=1), rngs=nnx.Rngs(3)))
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    for p, a, o in zip(*map(jax.tree.leaves, (params, abstract, one))):
        assert (p.shape, p.dtype) == (a.shape, a.dtype)
        if o.shape != p.shape:  # a layer axis: every layer the same values
            assert all(np.array_equal(p[i], p[0]) for i in range(cfg.num_layers))
            p = p[:1]
        np.testing.assert_allclose(p, o, rtol=1e-6, atol=0)  # jitted against eager: last bits
    layers = nnx.merge(graphdef, params).layers.mlp.up_proj.kernel[...]
    assert float(np.abs(layers[0]).max()) > 0  # random, not zeros


# -- benchmarks/soak.py, then decode_speed.py on its checkpoint ------------------------------


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    """soak.py's command at 2 steps, an evaluation after each (so a preemption and a resume), on
    a shrunk tiny model with a small evaluation: (stdout, summary file, workdir)."""
    base = tmp_path_factory.mktemp("soak")
    workdir, output = base / "run", base / "soak.json"
    out = run(
        "benchmarks/soak.py",
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        f"--output={output}",
        "--steps=2",
        "--eval_every=1",
        "--config.train.log_every=1",
        "--config.train.batch_size=2",
        "--config.data.num_synthetic_train=8",
        *SMALL_MODEL,
        "--config.eval.num_examples=2",
        "--config.eval.nll_examples=2",
        "--config.eval.batch_size=2",
        "--config.eval.max_new_tokens=8",
        "--config.eval.thresholds=(1.0,0.9)",
    )
    return out, output, workdir


@pytest.mark.slow
def test_soak(soak):
    out, output, workdir = soak
    summary = json.loads(output.read_text())
    assert json.loads(out[out.index("\n{\n") :]) == summary  # the summary printed last
    segments = [
        json.loads(line.removeprefix("soak: "))
        for line in out.splitlines()
        if line.startswith("soak: ")
    ]
    assert segments == summary["segments"]
    assert (summary["steps"], summary["eval_every"], summary["complete"]) == (2, 1, True)
    assert [s["step"] for s in segments] == [1, 2]
    for s in segments:
        for key in (
            "loss",
            "ar_nll",
            "train_s",
            "eval_s",
            "rss_first_step_mib",
            "rss_last_step_mib",
            "rss_mib",
        ):
            assert finite_positive(s[key]), (key, s)
        # Random init over 151,936 tokens: cross-entropies near ln(151936) = 11.9.
        assert 5 < s["loss"] < 15 and 5 < s["ar_nll"] < 15
    first, second = segments
    assert first["train_compiles"] > 0 and first["eval_compiles"] > 0
    # The soak's target: no train step compiles after the first one logged.
    assert summary["train_compiles_after_first_step"] == 0
    assert summary["compiles"] == sum(s["train_compiles"] + s["eval_compiles"] for s in segments)
    assert summary["compiles_after_warmup"] == second["train_compiles"] + second["eval_compiles"]
    assert (summary["warmup_rss_mib"], summary["final_rss_mib"]) == (
        first["rss_mib"],
        second["rss_mib"],
    )
    assert summary["rss_growth"] == pytest.approx(
        (second["rss_mib"] - first["rss_mib"]) / first["rss_mib"], abs=1e-4
    )
    assert (workdir / "config.json").exists() and (workdir / "checkpoints").is_dir()


@pytest.mark.slow
def test_decode_speed(soak, tmp_path):
    """decode_speed's command (model "trained") on the soak's checkpoint: one prompt of 4 tokens
    at batch 1 and one threshold, AR, one MARS decoder and transformers' generate."""
    workdir = soak[2]
    out = run(
        "benchmarks/decode_speed.py",
        "--model=trained",
        f"--workdir={workdir}",
        "--config=configs/tiny.py",
        "--num_prompts=1",
        "--max_new_tokens=4",
        "--batch_sizes=1",
        "--thresholds=0.9",
        "--decoders=sliding,transformers",
        "--repeats=1",
        f"--output_dir={tmp_path}",
    )
    rows = [json.loads(line) for line in (tmp_path / "decode_speed.jsonl").read_text().splitlines()]
    assert [r["decoder"] for r in rows] == ["ar", "sliding", "transformers"]
    assert [r["threshold"] for r in rows] == [1.0, 0.9, 1.0]
    for r in rows:
        assert (r["model"], r["batch"], r["prompts"], r["max_new_tokens"]) == ("trained", 1, 1, 4)
        assert 1 <= r["tokens"] <= 4 and r["forwards"] >= 1
        for key in ("seconds", "step_ms", "tokens_per_s", "speedup", "conversion"):
            assert finite_positive(r[key]), (key, r)
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert r["conversion"] == pytest.approx(r["speedup"] / r["tokens_per_forward"])
    ar, sliding, transformers = rows
    assert (ar["speedup"], ar["tokens_per_forward"], ar["block_size"]) == (1.0, 1.0, 1)
    assert sliding["block_size"] == 4  # the run's trained block size (configs/tiny.py)
    # The same greedy tokens from transformers' generate on the exported weights.
    assert transformers["same_as_ar"] == 1.0 and transformers["tokens"] == ar["tokens"]
    md = (tmp_path / "decode_speed.md").read_text()
    assert md.startswith("JAX ") and "trained: block size 4, max_new_tokens 4" in md
    assert [r[1] for r in header_and_body(md, "JAX ")[1]] == ["ar", "sliding", "transformers"]
    assert [r[1] for r in header_and_body(out, "JAX ")[1]] == ["ar", "sliding", "transformers"]
    assert (tmp_path / "decode_speed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- benchmarks/train_call_memory.py ---------------------------------------------------------


def test_decode_width():
    """The tiny shape at two batch sizes, a fitting and a wider prompt buffer, AR and B = 2:
    one table row per (batch, width), slots as the decoder sizes them, x fit = 1 on the fit."""
    for block_size in (1, 2):
        out = run(
            "benchmarks/decode_width.py",
            "--shape=tiny",
            "--batch_sizes=1,3",
            "--live=48",
            "--widths=fit,200",
            f"--block_size={block_size}",
            "--steps=2",
            "--repeats=1",
        )
        header, body = header_and_body(out, "| batch |")
        assert header == ["batch", "width", "slots", "step ms", "x fit"]
        assert [(r[0], r[1]) for r in body] == [
            ("1", "48"),
            ("1", "200"),
            ("3", "48"),
            ("3", "200"),
        ]
        window = 2 * block_size - 1
        for r in body:
            assert num(r[2]) == num(r[1]) + 2 * block_size + 2 * window  # prompt, budget, windows
            assert num(r[3]) > 0
        assert [num(r[4]) for r in body[::2]] == [1.0, 1.0]


def test_train_call_memory():
    """Two calls (the fewest with a growth figure) of one step each."""
    out = run("benchmarks/train_call_memory.py", "--calls=2", "--steps=1")
    lines = out.strip().splitlines()
    rss = [
        float(re.fullmatch(rf"call {i + 1}: RSS (\d+) MiB", line).group(1))
        for i, line in enumerate(lines[:-1])
    ]
    assert len(rss) == 2 and all(100 < x < 1e5 for x in rss)
    growth = re.fullmatch(
        r"growth from call 1 to call 2: (-?\d+\.\d)%; from call 2: (-?\d+\.\d)%", lines[-1]
    )
    assert growth, lines[-1]
    # Printed RSS is rounded to the MiB: the growth computed from it agrees to 0.2%.
    assert float(growth.group(1)) == pytest.approx(100 * (rss[1] / rss[0] - 1), abs=0.2)
    assert float(growth.group(2)) == 0.0


# -- benchmarks/hf_load_memory.py ------------------------------------------------------------


def test_hf_load_memory(tmp_path):
    """The docstring's command (no PYTHONPATH: the script puts the repository on sys.path) on
    configs/tiny.py's architecture: a 1-file bf16 checkpoint, loaded four ways."""
    m = tiny_config().model
    layer = (
        m.hidden_size * m.num_heads * m.head_dim
        + m.num_heads * m.head_dim
        + 2 * (m.hidden_size * m.num_kv_heads * m.head_dim + m.num_kv_heads * m.head_dim)
        + m.num_heads * m.head_dim * m.hidden_size
        + 3 * m.hidden_size * m.intermediate_size
        + 2 * m.hidden_size
    )
    params = m.vocab_size * m.hidden_size + m.num_layers * layer + m.hidden_size  # tied
    GiB = 2**30

    ckpt = tmp_path / "ckpt"
    out = run(
        "benchmarks/hf_load_memory.py", f"--checkpoint={ckpt}", "--shape=tiny", pythonpath=False
    )
    lines = out.strip().splitlines()
    files = list(ckpt.glob("*.safetensors"))
    assert lines[0] == f"checkpoint {ckpt}: 1 files, {2 * params / GiB:.2f} GiB (bf16)"
    assert len(files) == 1 and 2 * params < files[0].stat().st_size < 2 * params + 2**20
    pattern = (
        r"(\w+) +process (\d): peak RSS (\d+\.\d\d) GiB \(VmHWM (\d+\.\d\d), "
        r"(\d+\.\d\d) before loading\), held (\d+\.\d\d) GiB, (\d+\.\d) s"
    )
    found = [re.fullmatch(pattern, line) for line in lines[1:]]
    assert all(found), lines
    results = [(g[0], int(g[1]), *map(float, g[2:])) for g in (f.groups() for f in found)]
    assert [(r[0], r[1]) for r in results] == [
        ("host", 0),
        ("sharded", 0),
        ("sharded2", 0),
        ("sharded2", 1),
    ]
    for mode, _, peak, hwm, before, held, _seconds in results:
        # fp32 parameters held: all of them in one process, half in each of two.
        share = 4 * params / (2 if mode == "sharded2" else 1) / GiB
        assert held == pytest.approx(share, abs=0.006)
        assert 0 < before <= peak and peak == pytest.approx(hwm, abs=0.011)


# -- benchmarks/train_step.py --data: real rows, packed and unpacked --------------------------


@pytest.mark.slow
def test_train_step_on_real_rows_packed_and_not(tmp_path, smollm2_dir):
    """The documented ``--data`` command on configs/smollm2_gsm8k.py with its model swapped for a
    tiny one in SmolLM2's layout (its tokenizer files: the real row lengths) and 48 GSM8K train
    rows: each row's figures agree with the packing of those rows, computed here."""
    from mars_jax import packing, train_inputs
    from mars_jax.rows import read_rows
    from tests.helpers import write_smol_layout

    gsm8k = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    if not gsm8k.exists():
        pytest.skip("needs ../shared/data")
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text("".join(gsm8k.read_text().splitlines(keepends=True)[:48]))
    model_dir, _ = write_smol_layout(tmp_path / "smol", smollm2_dir)
    flags = [
        f"--config.init_from={model_dir}",
        f"--config.data.train_path={rows_file}",
        "--config.train.batch_size=2",
    ]
    out_json = tmp_path / "rows.json"
    out = run(
        "benchmarks/train_step.py",
        "--config=configs/smollm2_gsm8k.py:mars",
        "--data",
        "--max_lengths=128,512",
        "--packing=false,true",
        "--steps=1",
        f"--json_out={out_json}",
        *flags,
    )
    head, body = header_and_body(out, "| max_length")
    assert len(body) == 8
    result = json.loads(out_json.read_text())
    assert [(r["max_length"], r["packing"], r["objective"]) for r in result] == [
        (length, packed, objective)
        for length in (128, 512)
        for packed in (False, True)
        for objective in ("ar", "mars")
    ]
    # The oracle: the same rows, tokenized and packed here.
    spec = importlib.util.spec_from_file_location("_smol", ROOT / "configs" / "smollm2_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config("mars")
    cfg.init_from, cfg.data.train_path = str(model_dir), str(rows_file)
    tok = train_inputs.load_tokenizer(str(model_dir))
    assert len(read_rows(str(rows_file))) == 48
    for r in result:
        cfg.data.max_length = r["max_length"]
        examples = train_inputs.load_train_examples(cfg, tok)
        units = train_inputs.pack_examples(cfg, examples) if r["packing"] else examples
        assert r["padding"] == pytest.approx(packing.padding_fraction(units, r["max_length"]))
        assert r["steps_per_epoch"] == len(units) // 2
        assert r["rows_per_step"] == pytest.approx(2 * len(examples) / len(units))
        assert finite_positive(r["step_s"])
        assert r["label_tokens_per_s"] == pytest.approx(r["label_tokens_per_step"] / r["step_s"])
    by = {(r["max_length"], r["packing"], r["objective"]): r for r in result}
    for objective in ("ar", "mars"):
        unpacked, packed = by[(512, False, objective)], by[(512, True, objective)]
        assert packed["padding"] < unpacked["padding"]  # rows of ~200 tokens: two a sequence
        assert packed["rows_per_step"] > unpacked["rows_per_step"]
        assert packed["vs_unpacked"] == pytest.approx(
            packed["label_tokens_per_s"] / unpacked["label_tokens_per_s"]
        )
