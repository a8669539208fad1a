"""SmolLM2 on machines that lack something: tools/smollm2.py names the packages it needs;
launch/smollm2_gpu_parts.sh and launch/smollm2_gpu.sh (the fine-tune prepared for a lent GPU):
the GGUF's two parts join to the package's file, and the whole pipeline runs on CPU at its smoke
size with a tiny model in SmolLM2's layout, writing the curve, the speed table and the
summary."""

import hashlib
import json
import subprocess

import pytest

from tests.helpers import ROOT, python_env, write_smol_layout

GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"


def test_the_gguf_parts_join_to_the_packages_file(tmp_path, smollm2_dir):
    from tools import smollm2

    subprocess.run(
        ["bash", "launch/smollm2_gpu_parts.sh", str(tmp_path)],
        cwd=ROOT,
        env=python_env(PYTHONPATH="."),
        check=True,
        capture_output=True,
    )
    a = (tmp_path / ".gguf_a" / "smollm2.gguf.part").read_bytes()
    b = (tmp_path / ".gguf_b" / "smollm2.gguf.part").read_bytes()
    assert len(a) == 56 << 20 and 0 < len(b) < 56 << 20  # each fits one device call
    whole = smollm2.gguf_path().read_bytes()
    assert a + b == whole
    sha = (tmp_path / ".gguf_b" / "smollm2.gguf.sha256").read_text().strip()
    assert sha == hashlib.sha256(whole).hexdigest()


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_pipeline_at_its_smoke_size(tmp_path, smollm2_dir):
    if not GSM8K.exists():
        pytest.skip("needs ../shared/data")
    model, _ = write_smol_layout(tmp_path / "smol", smollm2_dir)
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 24), ("test", 4)):
        lines = (GSM8K / f"{split}.jsonl").read_text().splitlines(True)[:n]
        (data / f"gsm8k_{split}.jsonl").write_text("".join(lines))
    out = tmp_path / "out"
    env = python_env(
        PYTHONPATH=None,
        SMOLLM2=str(model),
        ACCELERATOR_DATA=str(data),
        WORK_DIR=str(tmp_path / "w"),
    )
    proc = subprocess.run(
        ["bash", "launch/smollm2_gpu.sh", "--smoke", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "smollm2_gpu_curve.json").read_text())
    assert [(r["step"], r["threshold"]) for r in rows] == [(0, 1.0), (2, 1.0), (2, 0.9)]
    assert rows[1]["rows_seen"] > 0
    summary = (out / "summary.md").read_text()
    for part in ("train_and_evaluate", "decode_speed"):
        assert f"## {part}\n\n`" in summary and "(exit 0," in summary
    assert "| step | rows seen | threshold |" in summary
    assert (out / "decode_speed" / "decode_speed.md").read_text() in summary
    assert (out / "smollm2_gpu_curve.png").stat().st_size > 1000


def test_the_builder_names_every_package_it_lacks(monkeypatch, tmp_path):
    """Without gguf and accelerate (a fresh install following the README), the builder names
    both and the install line before reading anything (transformers named one at a time)."""
    import importlib.util

    from tools import smollm2

    real = importlib.util.find_spec
    lacking = lambda name, *a: None if name in ("gguf", "accelerate") else real(name, *a)
    monkeypatch.setattr(importlib.util, "find_spec", lacking)
    with pytest.raises(ModuleNotFoundError) as e:
        smollm2.write_directory(tmp_path / "SmolLM2.gguf", tmp_path / "out")
    assert "missing: gguf, accelerate" in str(e.value)
    assert smollm2.NEEDS_INSTALL in str(e.value)
    assert not (tmp_path / "out").exists()
