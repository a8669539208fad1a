"""The smoke runners: ``runner(commands, request, tmp_path)`` runs one registry entry's documented
commands (`documented.REGISTRY`'s `Smoke` entries name theirs) and checks what they printed or
wrote."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.project.documented import ENTRIES, ROOT, SHARED_DATA, TIMEOUT_S, commands_of
from tests.project.smoke import (
    EVAL_SMOKE,
    MODEL_SMOKE,
    TRAIN_SMOKE,
    check_eval_tables,
    check_run_dir,
    needs_shared_data,
    prepare,
    resolve_subs,
    run_command,
    start_claims,
)

# -- the smoke runners: runner(commands, request, tmp_path) ---------------------------------


def run_quick_start(commands, request, tmp_path):
    run = request.getfixturevalue("tiny_run")
    assert (run / "mars" / "config.json").exists()


def run_two_stage_synthetic(commands, request, tmp_path):
    run = request.getfixturevalue("synthetic_run")
    config = json.loads((run / "mars" / "config.json").read_text())
    assert config["data"]["trim_vocab"] is True  # configs/synthetic.py's trimmed vocabulary


def run_two_stage_gsm8k(commands, request, tmp_path):
    run = request.getfixturevalue("gsm8k_run")
    config = json.loads((run / "mars" / "config.json").read_text())
    assert config["data"]["source"] == "gsm8k"


def run_two_stage_qwen0_5b(commands, request, tmp_path):
    needs_shared_data()
    hf = request.getfixturevalue("tiny_export")
    sft = tmp_path / "sft.jsonl"
    sft.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"What is {i} + {i}?"},
                        {"role": "assistant", "content": f"{i} + {i} = {2 * i}. #### {2 * i}"},
                    ]
                }
            )
            + "\n"
            for i in range(8)
        )
    )
    [command] = commands
    run = tmp_path / "qwen0_5b"
    proc = run_command(
        command,
        # The config packs rows into sequences of 512 (shorter ones make a batch of 2 from 8
        # rows) and trains with TPU's splash kernel (a CPU runs XLA's, as the docs say).
        TRAIN_SMOKE + EVAL_SMOKE + ["--config.data.max_length=128", "--config.model.attention=xla"],
        subs={"runs/qwen0_5b": run, "/models/Qwen2.5-0.5B-Instruct": hf, "/data/sft.jsonl": sft},
    )
    check_run_dir(run)
    check_eval_tables(proc.stdout, [run / "ar", run / "mars"])


def run_smollm2_gsm8k(commands, request, tmp_path):
    needs_shared_data()
    from tests.helpers import write_smol_layout

    model, _ = write_smol_layout(tmp_path / "smol", request.getfixturevalue("smollm2_dir"))
    [command] = commands
    run = tmp_path / "smollm2"
    proc = run_command(
        command,
        TRAIN_SMOKE[:3]
        + ["--config.data.max_length=64", "--config.train.save_every=2"]
        + EVAL_SMOKE,
        subs={"runs/smollm2": run},
        env={"SMOLLM2": str(model)},
        timeout=1200,  # seven programs, each compiling its own
    )
    check_run_dir(run)
    # The untuned model is evaluated where it is, its report in the run folder.
    check_eval_tables(proc.stdout, [model, run / "ar", run / "mars"])
    assert (run / "untuned" / "eval.json").exists() and not (model / "eval.json").exists()
    table = (run / "results" / "smollm2_gsm8k.md").read_text()
    assert all(label in table for label in ("SmolLM2-135M-Instruct", "AR control", "MARS B=4"))
    assert (run / "results" / "smollm2_gsm8k_loss.png").stat().st_size > 1000


def run_evaluate(commands, request, tmp_path):
    for command in commands:
        subs = model_subs(command, request)
        proc = run_command(command, EVAL_SMOKE[:3] + EVAL_SMOKE[4:], subs=subs)
        stage = "hf" if "runs/tiny/hf" in command.text else "mars"
        check_eval_tables(proc.stdout, [subs["runs/tiny"] / stage])
        if "thresholds=" in command.text:  # the documented thresholds are kept
            documented = re.search(r"thresholds=\(([^)]*)\)", command.text).group(1)
            for t in documented.replace(" ", "").split(","):
                assert f"| {float(t):.2f} |" in proc.stdout, (t, proc.stdout[-1500:])


def run_gsm8k_ar_control(commands, request, tmp_path):
    run = request.getfixturevalue("gsm8k_run")
    subs = {"runs/gsm8k": run}
    assert [c.text.split()[2] for c in commands] == ["mars_jax.train", "mars_jax.evaluate"]
    run_command(commands[0], TRAIN_SMOKE + MODEL_SMOKE, subs=subs)
    check_run_dir(run, ["ar_control"])
    proc = run_command(commands[1], EVAL_SMOKE[:3] + EVAL_SMOKE[4:], subs=subs)
    check_eval_tables(proc.stdout, [run / "ar_control"])
    assert "| 1.00 |" in proc.stdout and "| 0.90 |" not in proc.stdout  # its thresholds=(1.0,)


def run_configs_train(commands, request, tmp_path):
    [command] = commands
    run = request.getfixturevalue("tiny_run")
    out = tmp_path / "x"
    run_command(
        command,
        TRAIN_SMOKE + ["--config.train.save_every=2"],
        subs={"runs/tiny": run, "runs/x": out},
    )
    check_run_dir(tmp_path, ["x"])
    config = json.loads((out / "config.json").read_text())
    assert config["objective"]["block_size"] == 8 and config["objective"]["ar_weight"] == 0.0


def run_show_config(commands, request, tmp_path):
    [command] = commands
    out = run_command(command).stdout
    assert "train.batch_size = 8" in out.splitlines() and "objective.name = 'mars'" in out


def run_serve(commands, request, tmp_path):
    for command in commands:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        example = "--workdir=runs/tiny/mars " in command.text  # serving.md's client example
        extra = ["--max_new_tokens=64" if example else "--max_new_tokens=8"]  # the example's
        if "--warmup" in command.text:  # fewer prompt widths to compile
            extra.append("--max_prompt_len=64")
        argv, environ = prepare(command, extra, subs=model_subs(command, request))
        argv = [f"--port={port}" if a.startswith("--port=") else a for a in argv]
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(argv, cwd=ROOT, env=environ, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.time() + TIMEOUT_S
            while True:
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                assert time.time() < deadline, "the server never answered /health"
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as r:
                        if json.loads(r.read())["status"] == "ok":
                            break
                except OSError:
                    time.sleep(0.2)
            body = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 8}
            chat = urllib.request.Request(
                url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(chat, timeout=TIMEOUT_S) as r:
                answer = json.loads(r.read())
            assert answer["object"] == "chat.completion", answer
            assert 1 <= answer["usage"]["completion_tokens"] <= 8, answer
            if example:  # as printed, but for the port
                example = client_example().replace("127.0.0.1:8000", f"127.0.0.1:{port}")
                ran = subprocess.run(
                    [sys.executable, "-c", example],
                    cwd=ROOT,
                    env=environ,
                    capture_output=True,
                    text=True,
                    timeout=TIMEOUT_S,
                )
                assert ran.returncode == 0 and "tokens_per_forward" in ran.stdout, ran.stderr
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()


def client_example() -> str:
    """docs/serving.md's Python example with the official openai client."""
    text = (ROOT / "docs" / "serving.md").read_text()
    return re.search(r"With the official client.*?```python\n(.*?)```", text, re.S).group(1)


def run_smollm2_evaluate(commands, request, tmp_path):
    needs_shared_data()
    model = request.getfixturevalue("smollm2_dir")
    before = sorted(os.listdir(model))
    for command in commands:
        out = tmp_path / "untuned"
        subs = {"models/smollm2": model, "runs/smollm2_untuned": out}
        proc = run_command(command, EVAL_SMOKE[:3] + EVAL_SMOKE[4:], subs=subs)
        check_eval_tables(proc.stdout, [model])
        assert json.loads((out / "eval.json").read_text())["num_examples"] == 2
    assert sorted(os.listdir(model)) == before  # nothing written into the model's directory


def run_distill(commands, request, tmp_path):
    needs_shared_data()
    for command in {c.text: c for c in commands}.values():  # the same command in three docs
        out = tmp_path / "self.jsonl"
        subs = {**resolve_subs(command, request), "runs/distill/smollm2_gsm8k_train.jsonl": out}
        extra = ["--limit=3", "--max_new_tokens=8", "--batch_size=2"]
        proc = run_command(command, extra, subs=subs)
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert summary["rows"] == len(rows) and len(rows) + sum(summary["skipped"].values()) == 3
        assert all(r["messages"][-1]["role"] == "assistant" for r in rows)
        assert json.loads((tmp_path / "self.jsonl.progress.json").read_text())["done"] == 3


def model_subs(command, request) -> dict:
    """The documented model directories of ``command``: the tiny run, its export, the tiny
    checkpoint in the released format, SmolLM2's directory (each made on first use)."""
    if "models/smollm2" in command.text:
        return {"models/smollm2": request.getfixturevalue("smollm2_dir")}
    subs = {"runs/tiny": request.getfixturevalue("tiny_run")}
    if "runs/tiny/hf" in command.text:
        request.getfixturevalue("tiny_export")
    if "released/mars-b4" in command.text:
        subs["released/mars-b4"] = request.getfixturevalue("released_checkpoint")
    return subs


def run_evaluate_released(commands, request, tmp_path):
    needs_shared_data()
    for command in commands:
        subs = model_subs(command, request)
        model = subs["released/mars-b4"]
        before = sorted(p.name for p in model.iterdir())
        proc = run_command(command, EVAL_SMOKE, subs=subs)  # no thresholds documented
        check_eval_tables(proc.stdout, [model])
        assert re.search(rf"^{re.escape(str(model))} step 0: .*block_size 4", proc.stdout, re.M)
        assert sorted(p.name for p in model.iterdir()) == before  # nothing written into it


def run_generate(commands, request, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "What is 2 + 3?"}\n{"prompt": "What is 4 * 5?", "threshold": 0.9}\n'
    )
    for command in commands:
        subs = {**model_subs(command, request), "prompts.jsonl": prompts}
        out = run_command(command, ["--max_new_tokens=8"], subs=subs).stdout
        # A 2-step model's completion may be blank lines, but it is printed.
        assert out and "Traceback" not in out, command
        if "capital of France" in command.text:  # SmolLM2's own answer
            assert "Paris" in out, out
        if "--json" in command.text:
            rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            assert len(rows) == (2 if "--prompts_file" in command.text else 1), out
            for r in rows:
                assert {"prompt", "tokens", "text", "tokens_per_forward"} <= set(r)
                assert 1 <= len(r["tokens"]) <= 8


def run_smollm2_tool(commands, request, tmp_path):
    request.getfixturevalue("smollm2_dir")  # skips without the package; builds the cache once
    for command in commands:
        link = tmp_path / "models" / "smollm2"
        out = run_command(command, subs={"models/smollm2": link}).stdout
        assert link.is_symlink() and (link / "config.json").exists()
        assert out.strip() == str(link.resolve())


def run_real_model_parity(commands, request, tmp_path):
    for command in commands:
        out = tmp_path / "parity.json"
        subs = resolve_subs(command, request)
        run_command(command, ["--max_new_tokens=4", f"--output={out}"], subs=subs)
        report = json.loads(out.read_text())
        assert report["prompts"] == 8 and report["max_new_tokens"] == 4
        assert report["float32"]["prompts_equal"] == 1.0, report
        assert 0.0 <= report["bfloat16"]["mean_prefix_fraction"] <= 1.0


def run_export(commands, request, tmp_path):
    hf = request.getfixturevalue("tiny_export")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 32
    assert AutoTokenizer.from_pretrained(hf).mask_token == "<|mask|>"
    assert (hf / "README.md").exists()


def run_lm_eval_local(commands, request, tmp_path):
    needs_shared_data()
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm_eval is not installed (pip install -e '.[lm-eval]')")
    run = request.getfixturevalue("tiny_run")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "ds")}
    for command in commands:
        text = re.sub(r"--limit \d+", "--limit 2", command.text)
        text = re.sub(r"--batch_size \d+", "--batch_size 2", text)
        out = tmp_path / "lm_eval_out"
        run_command(
            text,
            ["--gen_kwargs", "max_gen_toks=8"],
            subs={"runs/tiny": run, "lm_eval_out": out},
            env=env,
        )
        (results,) = out.glob("*/results_*.json")
        report = json.loads(results.read_text())
        assert report["n-samples"]["gsm8k_local"]["effective"] == 2
        assert 0.0 <= report["results"]["gsm8k_local"]["exact_match,strict-match"] <= 1.0


def run_serve_load(commands, request, tmp_path):
    for i, command in enumerate(commands):
        out = tmp_path / f"out{i}"
        extra = ["--requests=4", "--rate=20", "--max_seconds=30", "--min_tokens=2"]
        # One prefill width (16; the engine's warmup compiles every width up to the chunk, 7
        # of them at the default 128, for each mode).
        extra += ["--max_tokens=4", "--slots=2", "--prefill_chunk=16", f"--output_dir={out}"]
        run_command(command, extra, subs=resolve_subs(command, request))
        rows = [json.loads(line) for line in (out / "serve_load.jsonl").read_text().splitlines()]
        modes = re.search(r"--modes=(\S+)", command.text)
        modes = modes.group(1).split(",") if modes else ["continuous", "static", "ar"]
        assert [r["mode"] for r in rows] == modes, rows
        assert all(r["requests"] == r["sent"] == 4 for r in rows), rows
        assert (out / "serve_load.md").read_text().count("\n| ") == len(modes) + 1


def run_serve_one_user(commands, request, tmp_path):
    needs_shared_data()
    for i, command in enumerate(commands):
        out = tmp_path / f"out{i}"
        extra = ["--num_prompts=1", "--passes=2", "--max_new_tokens=4", "--thresholds=1.0"]
        extra.append(f"--output_dir={out}")
        run_command(command, extra, subs=resolve_subs(command, request))
        rows = json.loads((out / "serve_one_user.json").read_text())["rows"]
        assert [(r["threshold"], r["prompts"], r["same_text"]) for r in rows] == [(1.0, 2, 2)]
        assert rows[0]["generate_tokens"] == rows[0]["serve_tokens"] == 8
        # Each pair's ratio is its tokens/s over the server's; the median lies among them.
        assert len(rows[0]["pair_ratios"]) == 2
        assert (
            min(rows[0]["pair_ratios"])
            <= rows[0]["median_pair_ratio"]
            <= max(rows[0]["pair_ratios"])
        )


def run_decode_speed(commands, request, tmp_path):
    for i, command in enumerate(commands):
        if "gsm8k" in command.text:
            needs_shared_data()
        out = tmp_path / f"out{i}"
        subs = resolve_subs(command, request)
        # --model=both's second model is the random Qwen2.5-0.5B shape: the tiny shape here.
        models = ["--model=trained,tiny_shape"] if "--model=both" in command.text else []
        run_command(
            command,
            models
            + [
                "--num_prompts=1",
                "--max_new_tokens=4",
                "--batch_sizes=1",
                "--thresholds=0.9",
                "--decoders=sliding",
                "--repeats=1",
                "--shape_max_new_tokens=4",
                "--shape_prompt_len=8",
                f"--output_dir={out}",
            ],
            subs=subs,
        )
        rows = [json.loads(line) for line in (out / "decode_speed.jsonl").read_text().splitlines()]
        models = {r["model"] for r in rows}
        assert "trained" in models, rows
        if "--model=both" in command.text:
            assert len(models) == 2, models
        # A model without <|mask|> (SmolLM2) times ar and transformers only.
        mars = set() if "models/smollm2" in command.text else {"sliding"}
        assert {r["decoder"] for r in rows} >= {"ar"} | mars
        assert (out / "decode_speed.md").read_text().startswith("JAX ")


def run_decode_speed_accept(commands, request, tmp_path):
    for command in commands:
        out = tmp_path / "accept"
        stdout = run_command(
            command,
            [
                "--shapes=tiny",
                "--block_sizes=2",
                "--accept=1,2",
                "--steps=2",
                "--repeats=1",
                "--prompt_len=8",
                "--modes=ar,sliding",
                f"--output_dir={out}",
            ],
        ).stdout
        rows = [json.loads(line) for line in (out / "decode_step.jsonl").read_text().splitlines()]
        assert [(r["mode"], r["accept"]) for r in rows] == [
            ("ar", 1),
            ("sliding", 1),
            ("sliding", 2),
        ]
        if "--parts" in command.text:
            assert (out / "decode_step_parts.md").exists()
            assert "| layers ms | projection ms | choice ms |" in stdout


def run_accelerator_data(commands, request, tmp_path):
    if not (SHARED_DATA / "gsm8k" / "train.jsonl").exists():
        pytest.skip("needs ../shared/data")
    for command in commands:
        out = tmp_path / "accelerator_data"
        run_command(command, [str(out)])
        assert (out / "gsm8k_train.jsonl").read_bytes() == (
            SHARED_DATA / "gsm8k" / "train.jsonl"
        ).read_bytes()
        if (ROOT / "models" / "smollm2" / "config.json").exists():
            assert (out / "smollm2_shape" / "tokenizer.json").exists()


def run_roofline(commands, request, tmp_path):
    for command in commands:
        out = run_command(command).stdout
        assert "### Ridge" in out
        if "--measure_cpu" in command.text:
            assert "CPU (measured)" in out


def run_claims_smoke(commands, request, tmp_path):
    # The documented smoke commands differ only in --workdir: one run (started in the
    # background with the other expensive runs) covers them.
    assert len({re.sub(r"--workdir=\S+", "", c.text) for c in commands}) == 1
    background = request.getfixturevalue("background")
    if "claims_smoke" not in background:
        background["claims_smoke"] = start_claims(tmp_path)
    job, work = background["claims_smoke"]
    out = job.wait()
    assert "### smoke: " in out, out[-2000:]
    assert (work / "results" / "smoke.md").read_text() in out


TPU_ENV = {
    "NAME": "mars-v5e",
    "ZONE": "us-west4-a",
    "ACCELERATOR_TYPE": "v5litepod-16",
    "RUNTIME_VERSION": "v2-alpha-tpuv5-lite",
    "PROJECT": "my-project",
}


def run_tpu_vm(commands, request, tmp_path):
    for command in commands:
        argv = shlex.split(command.text)
        insert = None if "--dry_run" in argv else (2, ["--dry_run"])
        out = run_command(command, env=TPU_ENV, insert=insert).stdout
        gcloud = [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ gcloud")]
        ssh = [c for c in gcloud if c[3:5] == ["tpu-vm", "ssh"]]
        assert ssh and ssh[0][5] == TPU_ENV["NAME"], out
        # The last ssh runs the documented command on every worker, its arguments as given.
        remote = shlex.split(ssh[-1][-1].removeprefix("--command="))
        start = remote.index("{") + 1
        assert remote[start : remote.index(";", start)] == argv[argv.index("--") + 1 :], out


def run_xm_launch(commands, request, tmp_path):
    for command in commands:
        spec = json.loads(run_command(command).stdout)
        stage = re.search(r"--stage=(\w+)", command.text)
        stages = ["ar", "mars"] if stage is None or stage.group(1) == "both" else [stage.group(1)]
        assert [j["stage"] for j in spec["jobs"]] == stages
        config = re.search(r"--config=(\S+)", command.text).group(1)
        assert all(f"--config={config}:{j['stage']}" in j["argv"] for j in spec["jobs"])


def run_gcs_emulator(commands, request, tmp_path):
    [serve] = [c for c in commands if c.text.startswith("python tests/gcs_emulator.py")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = re.search(r"--root=(\S+)", serve.text).group(1)
    argv, environ = prepare(serve, subs={root: tmp_path / "gcs"})
    argv = [f"--port={port}" if a.startswith("--port=") else a for a in argv]
    proc = subprocess.Popen(argv, cwd=ROOT, env=environ, stdout=subprocess.PIPE, text=True)
    try:
        exports = []
        for line in proc.stdout:  # the exports, then "# serving ..." once it answers
            if line.startswith("# serving "):
                break
            exports.append(line.strip())
        assert proc.poll() is None, exports
        # What it prints is what the docs tell to export (the documented port there).
        documented = (ROOT / serve.file).read_text()
        for line in exports:
            assert line.replace(f":{port}", ":4443") in documented, line
        env = dict(e.removeprefix("export ").split("=", 1) for e in exports)
        assert env["STORAGE_EMULATOR_HOST"] == f"http://127.0.0.1:{port}", env
        for command in commands:
            if command is serve:
                continue
            workdir = re.search(r"--workdir=gs://(\S+)", command.text).group(1)
            proc_run = run_command(command, TRAIN_SMOKE + MODEL_SMOKE, env=env, timeout=120)
            steps = tmp_path / "gcs" / workdir / "checkpoints"
            committed = [p.name for p in steps.iterdir() if (p / "commit_success.txt").exists()]
            assert committed == ["2"], (committed, proc_run.stderr[-3000:])
            # The last export turns off gcsfs's bucket-type probe (and its warning).
            assert "Could not determine bucket type" not in proc_run.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        with socket.socket() as s:  # the server stopped with it: nothing listens on its port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (closed connections may)
            s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_entry(entry: str, request, tmp_path) -> None:
    """`test_smoke[entry]` of each test file: the background runs of the requesting file started
    (the first test starts them), then the entry's runner on its documented commands."""
    commands = commands_of(entry)
    assert commands, entry
    request.getfixturevalue("background")
    globals()[ENTRIES[entry].runner](commands, request, tmp_path)
