"""experiments/smollm2_curve.py (the SmolLM2 learning curve) on configs/smollm2_curve.py with a
tiny model in SmolLM2's layout and 24 GSM8K rows: its points are the evaluations of the steps
asked for, the rows seen are those the training logged, and a rerun adds nothing."""

import collections
import json

import pytest

from experiments import smollm2_curve
from mars_jax import config, train
from tests.helpers import ROOT, config_file, write_smol_layout

pytestmark = pytest.mark.slow
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"


def load(stage):
    return config_file("smollm2_curve", stage)


def test_both_stages_pass_the_checks():
    for stage in ("mars", "ar", "self"):
        cfg = load(stage)
        config.validate(cfg, training=True, paths=False)
        assert cfg.data.packing and cfg.train.schedule == "constant" and cfg.train.log_every == 1
    assert load("ar").eval.thresholds == (1.0,)
    # The self-distilled run differs from MARS's in its training rows only.
    mars, own = load("mars"), load("self")
    assert (own.data.source, own.data.eval_format) == ("messages", "gsm8k")
    own.data.update(source="gsm8k", train_path=mars.data.train_path, eval_format="")
    assert own.to_dict() == mars.to_dict()


def test_the_curve_evaluates_each_step_once(tmp_path, smollm2_dir, monkeypatch):
    if not GSM8K.exists():
        pytest.skip("needs ../shared/data")
    model, _ = write_smol_layout(tmp_path / "smol", smollm2_dir)
    rows_file = tmp_path / "train.jsonl"
    rows_file.write_text("".join((GSM8K / "train.jsonl").read_text().splitlines(True)[:24]))
    cfg = load("mars")
    cfg.init_from, cfg.data.train_path = str(model), str(rows_file)
    cfg.train.update(num_steps=6, save_every=2)
    cfg.data.max_length = 128
    cfg.eval.update(num_examples=2, batch_size=2, nll_examples=2, max_new_tokens=4)
    cfg.eval.thresholds = (1.0, 0.9)
    out = tmp_path / "curve.json"
    workdir = str(tmp_path / "runs" / "mars")
    rows = smollm2_curve.curve(cfg, workdir, [0, 2, 4], str(out), "mars")
    assert json.loads(out.read_text()) == rows
    assert [(r["step"], r["threshold"]) for r in rows] == [
        (0, 1.0),
        (2, 1.0),
        (2, 0.9),
        (4, 1.0),
        (4, 0.9),
    ]
    metrics = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # one segment to 2, then on to 4
    by_step = {r["step"]: r for r in rows}
    assert by_step[0]["rows_seen"] == 0 and by_step[0]["tokens_per_forward"] == 1.0
    assert by_step[2]["rows_seen"] == sum(m["rows"] for m in metrics[:2])
    assert by_step[4]["rows_seen"] == sum(m["rows"] for m in metrics)
    assert 0 < by_step[2]["train_hours"] < by_step[4]["train_hours"]
    for step in (2, 4):
        report = json.load(
            open(sorted((tmp_path / "runs" / "mars" / "eval").glob(f"step_{step}_*.json"))[0])
        )
        one = [r for r in rows if r["step"] == step and r["threshold"] == 1.0][0]
        assert (
            one["nll"] == report["ar_nll"] and one["accuracy"] == report["results"][0]["accuracy"]
        )
    assert (tmp_path / "curve.png").stat().st_size > 1000
    assert smollm2_curve.curve(cfg, workdir, [0, 2, 4], str(out), "mars") == rows  # nothing new
    assert len(list((tmp_path / "runs" / "mars" / "eval").glob("step_*.json"))) == 2

    # A signal ends the segment to step 6 at step 5 (saved): no point, the clock keeps step 5,
    # and the rerun's point counts both segments' training time.
    with monkeypatch.context() as m:
        m.setattr(train.Preemption, "stop", lambda self, done: done == 5)
        with pytest.raises(SystemExit, match="stopped at step 5 .* before step 6"):
            smollm2_curve.curve(cfg, workdir, [6], str(out), "mars")
    assert json.loads(out.read_text()) == rows
    clock = json.loads(open(f"{workdir}/curve_train_seconds.json").read())
    assert sorted(map(int, clock)) == [2, 4, 5] and clock["4"] < clock["5"]
    six = [r for r in smollm2_curve.curve(cfg, workdir, [6], str(out), "mars") if r["step"] == 6]
    clock = json.loads(open(f"{workdir}/curve_train_seconds.json").read())
    assert clock["5"] < clock["6"] and six[0]["train_hours"] == round(clock["6"] / 3600, 4)
    assert [m["step"] for m in map(json.loads, open(f"{workdir}/metrics.jsonl"))] == [*range(1, 7)]


def test_the_self_distilled_run_trains_on_answer_rows(tmp_path, smollm2_dir):
    """``:self`` on rows as `mars_jax.distill` writes them (here its writer given the reference
    answers' ids as the decode): the run trains on them and is evaluated on GSM8K test."""
    import numpy as np

    from mars_jax import decode, distill, sources
    from mars_jax.tokenizer import load_tokenizer

    if not GSM8K.exists():
        pytest.skip("needs ../shared/data")
    model, _ = write_smol_layout(tmp_path / "smol", smollm2_dir)
    tok = load_tokenizer(str(model))
    train = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()[:12]]
    prompts = [
        distill.Prompt(i, distill.prompt_messages(r, "gsm8k"), None, [])
        for i, r in enumerate(train)
    ]
    answers = [tok.encode(r["answer"]) for r in train]
    tokens = np.zeros((len(train), max(map(len, answers)) + 1), np.int32)
    for i, a in enumerate(answers):
        tokens[i, : len(a)] = a
    lengths = np.array(list(map(len, answers)), np.int32)
    out = decode.DecodeOutput(tokens, lengths, lengths + 1, lengths + 1, 1)
    opened = sources.Opened("m", None, tok, 0, 1, (), 0, None)
    rows = distill.answer_rows(opened, prompts, out, tokens.shape[1], collections.Counter())
    assert [r["messages"][1]["content"] for r in rows] == [tok.decode(a) for a in answers]
    rows_file = tmp_path / "self.jsonl"
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))

    cfg = load("self")
    cfg.init_from, cfg.data.train_path = str(model), str(rows_file)
    cfg.train.update(num_steps=2, save_every=2)
    cfg.data.max_length = 128
    cfg.eval.update(num_examples=2, batch_size=2, nll_examples=2, max_new_tokens=4)
    cfg.eval.thresholds = (1.0,)
    workdir = str(tmp_path / "runs" / "self")
    output = tmp_path / "curve.json"
    theirs = {"run": "mars", "step": 7, "rows_seen": 28, "threshold": 1.0, "nll": 1.0}
    theirs.update(tokens_per_forward=1.0, accuracy=0.0, mean_length=9.0, agreement=1.0)
    output.write_text(json.dumps([theirs]))
    real_point = smollm2_curve.point

    def point(*args):  # another run adds a point while this one trains and evaluates
        output.write_text(json.dumps([theirs, {**theirs, "step": 8}]))
        return real_point(*args)

    smollm2_curve.point = point
    try:
        rows = smollm2_curve.curve(cfg, workdir, [2], str(output), "self")
    finally:
        smollm2_curve.point = real_point
    assert [(r["run"], r["step"]) for r in rows] == [("mars", 7), ("mars", 8), ("self", 2)]
    assert json.loads(output.read_text()) == rows
    points = [r for r in rows if r["run"] == "self"]
    metrics = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
    assert points[0]["rows_seen"] == sum(m["rows"] for m in metrics) > 0
    assert json.loads(open(f"{workdir}/config.json").read())["data"]["source"] == "messages"
