r"""Tests of the answer grading (mars_jax.grading): numerically equal answers score as equal,
whatever form GSM8K references and model completions write them in ($1,000, 5.50, "is 18.",
\boxed{...}, 25%, 1/2, ...), and different numbers never do (18 vs 180, 1.5 vs 15, European
"1.000" vs 1,000); and of mars_jax.evaluate's wall clock: each threshold's decode timed best of
eval.timing_repeats after an untimed warm-up, against AR decoding of the same prompts."""

import collections
import json
import time
import types
from fractions import Fraction

import numpy as np
import pytest

from mars_jax import decode, evaluate, grading, plots
from tests.base.test_plots import report

# (completion, reference): the same number.
EQUAL = [
    ("#### 1000", "Natalia sold 1,000 clips.\n#### 1,000"),
    ("The total is $1,000.", "#### 1,000"),
    ("She pays $1,000.00 in all.", "#### 1000"),
    ("#### 5.50", "#### 5.5"),
    ("It costs 18.00 dollars", "#### 18"),
    ("So the answer is 18.", "#### 18"),
    ("18.0", "#### 18"),
    ("#### 0.50", "#### .5"),
    ("#### 12,345,678.90", "#### 12345678.9"),
    ("The change is -5 degrees.", "#### -5"),
    ("The change is \u22125 degrees.", "#### -5"),  # U+2212 MINUS SIGN
    ("He lost -$5 today", "#### -5"),
    ("He lost $-5 today", "#### -5"),
    ("#### +7", "#### 7"),
    ("The discount is 25%.", "#### 25"),
    (r"The discount is $25\%$.", "#### 25"),
    ("She ate 1/2 of it", "#### 0.5"),
    ("6/4 = 1.5, so 3/2", "#### 1.5"),
    (r"Hence \boxed{1{,}000}.", "#### 1,000"),
    (r"\boxed{\$18.00} and then 3 more", "#### 18"),
    (r"\boxed{18 \text{ dollars}}", "#### 18"),
    (r"the answer is $\boxed{\frac{3}{4}}$", "#### 0.75"),
    (r"\boxed{-\dfrac{10}{4}}", "#### -2.5"),
    ("**Answer:** 42", "#### 42"),
    ("3 + 4 = 7\n#### 7\nThe user asks 99 more", "#### 7"),  # the first number after ####
    ("There are 10 apples and 8 pears: 18 fruits in all", "#### 18"),  # the last number
    ("5 - 3 = 2", "#### 2"),
]

# (completion, reference): different numbers, or no answer.
DIFFERENT = [
    ("#### 18", "#### 180"),
    ("#### 180", "#### 18"),
    ("#### 1.5", "#### 15"),
    ("#### 15", "#### 1.5"),
    ("#### 1.000", "#### 1,000"),  # a point is a decimal point, never a thousands separator
    ("#### 3,5", "#### 3.5"),  # a comma is a thousands separator (groups of 3), never a point
    ("#### 1 000", "#### 1000"),  # spaces separate numbers
    ("#### 1,00", "#### 100"),
    ("#### 18", "#### -18"),
    ("#### -5", "#### 5"),
    ("The discount is 25%.", "#### 0.25"),  # a percent sign is dropped, not applied
    ("3-5", "#### -5"),  # a hyphen after a digit is not a sign
    ("#### 2/3", "#### 0.67"),
    ("#### 0.1", "#### 0.10000001"),
    ("no number here", "#### 0"),
    ("5 apples, then #### and no number", "#### 5"),
    ("#### 5", "no number in the reference"),
    (r"\boxed{7} after 7.5", "#### 7.5"),  # the boxed answer wins over a later number
    ("1 1/2 cups", "#### 1.5"),  # by decision no mixed numbers: the last number is 1/2
]


@pytest.mark.parametrize("completion,reference", EQUAL)
def test_equal_numbers_match(completion, reference):
    answer = grading.extract_answer(completion)
    assert answer is not None and answer == grading.extract_answer(reference)
    assert grading.answers_match(completion, reference)
    assert grading.answer_value(completion) == grading.answer_value(reference)


@pytest.mark.parametrize("completion,reference", DIFFERENT)
def test_different_numbers_do_not_match(completion, reference):
    a, b = grading.extract_answer(completion), grading.extract_answer(reference)
    assert a is None or b is None or a != b
    assert not grading.answers_match(completion, reference)


@pytest.mark.parametrize(
    "text,value",
    [
        ("#### 1,000", Fraction(1000)),
        ("costs $5.50.", Fraction(11, 2)),
        ("#### -12,345.25", Fraction(-49381, 4)),
        (r"\boxed{\frac{1}{3}}", Fraction(1, 3)),
        ("divide by 10/0 and 4", Fraction(4)),  # a zero denominator is no number
        ("version 2", Fraction(2)),
        ("\u7b54\u6848\u662f18", Fraction(18)),  # after non-Latin letters too
        ("no digits", None),
        ("####", None),
        (r"\boxed{} 12", Fraction(12)),  # an empty box: the last number of the text
        (r"\boxed{5 + \boxed{6} = 11", Fraction(6)),  # the last box (in an unclosed one)
        (r"7 and \boxed{12", Fraction(12)),  # an unclosed box runs to the end
    ],
)
def test_answer_value(text, value):
    assert grading.answer_value(text) == value


@pytest.mark.parametrize(
    "value,text",
    [
        (Fraction(1000), "1000"),
        (Fraction(-3), "-3"),
        (Fraction(11, 2), "5.5"),
        (Fraction(1, 4), "0.25"),
        (Fraction(-1, 8), "-0.125"),
        (Fraction(1, 10**7), "0.0000001"),
        (Fraction(123456789, 10), "12345678.9"),
        (Fraction(1, 3), "1/3"),
        (Fraction(-7, 6), "-7/6"),
        (Fraction(0), "0"),
    ],
)
def test_format_number_is_canonical(value, text):
    assert grading.format_number(value) == text
    assert Fraction(text) == value


def test_accuracy_compares_numbers():
    completions = ["#### 1000.00", "The answer is $18.", "#### 180", "no idea", r"\boxed{25\%}"]
    references = ["#### 1,000", "#### 18", "#### 18", "#### 0", "#### 25"]
    assert grading.accuracy(completions, references) == pytest.approx(3 / 5)
    assert grading.accuracy([], []) == 0.0
    with pytest.raises(ValueError, match="2 completions for 1 references"):
        grading.accuracy(["1", "2"], ["#### 1"])


@pytest.mark.parametrize("thresholds", [(0.9, 1.5), (-0.5,), (0.0,), (float("nan"),), ()])
def test_thresholds_outside_0_1_are_refused_before_loading(thresholds, tmp_path):
    # The workdir does not exist: the thresholds are checked before the checkpoint is loaded
    # (which would raise FileNotFoundError), and the message names the config field.
    from tests.helpers import tiny_config

    cfg = tiny_config()
    cfg.eval.thresholds = thresholds
    with pytest.raises(ValueError, match=r"eval\.thresholds"):
        evaluate.evaluate(cfg, str(tmp_path / "no_run"))


def test_each_evaluation_is_kept_in_its_own_file(tmp_path):
    # Two evaluations of the same step with different thresholds: both stay findable under
    # eval/, and eval.json is the latest.
    first, second = report(7, [0.9], seed=0), report(7, [0.5], seed=1)
    paths = [evaluate.write_report(str(tmp_path), r) for r in (first, second)]
    assert len(set(paths)) == 2
    files = sorted((tmp_path / "eval").glob("*.json"))
    assert [f.name.startswith("step_7_") for f in files] == [True, True]
    assert sorted(json.loads(f.read_text())["results"][0]["threshold"] for f in files) == [
        0.5,
        0.9,
    ]
    assert json.loads(open(paths[1]).read()) == second
    assert json.loads((tmp_path / "eval.json").read_text()) == second


# ----------------------------------------------------------------------------------------------
# Wall clock: best of eval.timing_repeats after an untimed warm-up, against AR decoding.


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step trimmed stage-1 run (trained block size 4): (workdir, config)."""
    from mars_jax import train
    from tests.train_runs import get_config

    cfg = get_config("ar", data__trim_vocab=True, train__num_steps=2, eval__timing_repeats=2)
    workdir = str(tmp_path_factory.mktemp("runs") / "ar")
    train.train(cfg, workdir)
    return workdir, cfg


def _clocked(monkeypatch):
    """Wraps decode.generate_batched to record each call as (block_size, threshold, seconds,
    generated tokens) on a fake clock of evaluate's own: the first decode at a block size (the
    warm-up, which compiles) takes 1e6 s, every other one 1..99 s (random integers)."""
    real, clock, calls = decode.generate_batched, [0.0], []
    rng = np.random.default_rng(0)

    def counting(model, prompts, options, **kwargs):
        out = real(model, prompts, options, **kwargs)
        warm_up = all(b != options.block_size for b, *_ in calls)
        took = 1e6 if warm_up else float(rng.integers(1, 100))
        clock[0] += took
        calls.append((options.block_size, options.threshold, took, int(out.accepted.sum())))
        return out

    monkeypatch.setattr(decode, "generate_batched", counting)
    fake_time = types.SimpleNamespace(**{**vars(time), "perf_counter": lambda: clock[0]})
    monkeypatch.setattr(evaluate, "time", fake_time)
    return calls


def _best(calls, key):
    """(fewest seconds, generated tokens) of the timed (not warm-up) calls at ``key``."""
    timed = [
        (s, n)
        for i, (b, t, s, n) in enumerate(calls)
        if (b, t) == key and any(c[0] == b for c in calls[:i])
    ]
    assert len({n for _, n in timed}) == 1  # greedy: every repeat decodes the same tokens
    return min(s for s, _ in timed), timed[0][1]


def test_wall_clock_is_the_best_of_repeats_after_an_untimed_warm_up(trained, monkeypatch):
    workdir, cfg = trained
    calls = _clocked(monkeypatch)
    report = evaluate.evaluate(cfg, workdir)
    assert report["block_size"] == 4 and report["timing_repeats"] == 2
    keys = [(b, t) for b, t, *_ in calls]
    # One warm-up per block size first (4: the threshold-1.0 reference; 1: AR), then each
    # threshold and the AR baseline (block size 1, threshold 1.0) timed twice each.
    assert keys[:2] == [(4, 1.0), (1, 1.0)]
    assert collections.Counter(keys[2:]) == {(1, 1.0): 2, (4, 1.0): 2, (4, 0.9): 2}
    ar_seconds, ar_tokens = _best(calls, (1, 1.0))
    assert report["ar_seconds"] == ar_seconds < 1e6
    assert report["ar_tokens_per_s"] == pytest.approx(ar_tokens / ar_seconds, rel=1e-12)
    for r in report["results"]:
        seconds, tokens = _best(calls, (4, r["threshold"]))
        assert r["seconds"] == seconds < 1e6  # the warm-up is not timed
        assert r["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-12)
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / report["ar_tokens_per_s"])
        assert r["conversion"] == pytest.approx(r["speedup"] / r["tokens_per_forward"])
    table = plots.format_table(report)
    assert f"{report['ar_tokens_per_s']:.1f} tokens/s, best of 2" in table
    for r in report["results"]:
        assert f"| {r['speedup']:.2f}x | {r['conversion']:.2f} |" in table


def test_timed_decodes_log_progress_and_time_left(trained, monkeypatch):
    """After each timed configuration, evaluate logs how many of them are done and the time
    left at the mean pace so far, on its own (fake) clock from the first timed decode."""
    workdir, cfg = trained
    calls = _clocked(monkeypatch)
    lines = []
    fake_logging = types.SimpleNamespace(info=lambda msg, *args: lines.append(msg % args))
    monkeypatch.setattr(evaluate, "logging", fake_logging)
    evaluate.evaluate(cfg, workdir)
    timed = calls[2:]  # after the two warm-ups; each configuration runs timing_repeats times
    keys = list(dict.fromkeys((b, t) for b, t, *_ in timed))
    progress = [line for line in lines if "timed decodes done" in line]
    assert len(progress) == len(keys) == 3
    for i, line in enumerate(progress, 1):
        elapsed = sum(s for b, t, s, _ in timed if (b, t) in keys[:i])
        left = elapsed / i * (len(keys) - i)
        assert line == f"{i} of 3 timed decodes done in {elapsed:.0f} s; about {left:.0f} s left"


def test_ar_decoding_is_its_own_baseline(trained, monkeypatch):
    """Decoded at block size 1, threshold 1.0 is the AR baseline: measured once (not twice),
    speedup exactly 1."""
    workdir, cfg = trained
    cfg = cfg.copy_and_resolve_references()
    cfg.eval.block_size = 1
    calls = _clocked(monkeypatch)
    report = evaluate.evaluate(cfg, workdir)
    keys = [(b, t) for b, t, *_ in calls]
    assert keys[0] == (1, 1.0)
    assert collections.Counter(keys[1:]) == {(1, 1.0): 2, (1, 0.9): 2}
    one = report["results"][0]
    assert one["threshold"] == 1.0 and one["tokens_per_forward"] == 1.0
    assert (one["seconds"], one["speedup"], one["conversion"]) == (report["ar_seconds"], 1.0, 1.0)
    assert "| 1.00x | 1.00 |" in plots.format_table(report)


def test_untimed_evaluation_decodes_each_threshold_once_with_the_same_results(trained, monkeypatch):
    """eval.timing_repeats=0 (a learning curve's points): one decode per threshold, the
    threshold-1.0 one the reference, no AR decode; every measure but the wall clock is the timed
    evaluation's."""
    workdir, cfg = trained
    timed = evaluate.evaluate(cfg, workdir)
    cfg = cfg.copy_and_resolve_references()
    cfg.eval.timing_repeats = 0
    cfg.eval.thresholds = (0.9,)  # 1.0 is decoded all the same: agreement needs it
    calls = _clocked(monkeypatch)
    report = evaluate.evaluate(cfg, workdir)
    assert [(b, t) for b, t, *_ in calls] == [(4, 1.0), (4, 0.9)]
    assert report["ar_tokens_per_s"] is None and report["ar_seconds"] is None
    (untimed,) = report["results"]
    (same,) = [r for r in timed["results"] if r["threshold"] == 0.9]
    speed = {"tokens_per_s", "seconds", "speedup", "conversion"}
    assert speed.isdisjoint(untimed)
    assert untimed == {k: v for k, v in same.items() if k not in speed}
    assert report["ar_nll"] == timed["ar_nll"]
    assert "| - | - | - |" in plots.format_table(report)


def test_table_of_a_report_without_wall_clock_columns():
    """An eval.json written before speedup was measured (export.py tabulates old runs)."""
    table = plots.format_table(report(7, [0.9], seed=0))
    assert "speedup | conversion" in table and "| - | - |" in table and "best of" not in table


# ----------------------------------------------------------------------------------------------
# A model that is read is never written.


def _snapshot(path):
    """{relative path: bytes} of every file under ``path`` (links followed)."""
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_a_model_directory_is_read_never_written(tmp_path):
    """evaluate on a Hugging Face directory (a model cache, a link into one) writes nothing into
    it: the report goes to output_dir, or is only printed. A run directory keeps its own."""
    from tests.helpers import write_released
    from tests.train_runs import get_config

    model = tmp_path / "released"
    write_released(model, block_size=4)
    before = _snapshot(model)
    cfg = get_config(
        "mars",
        eval__num_examples=2,
        eval__batch_size=2,
        eval__max_new_tokens=4,
        eval__nll_examples=2,
        eval__timing_repeats=1,
        eval__thresholds=(1.0, 0.9),
    )
    evaluate.evaluate(cfg, str(model))
    assert _snapshot(model) == before
    out = tmp_path / "reports"
    report = evaluate.evaluate(cfg, str(model), output_dir=str(out))
    assert _snapshot(model) == before
    written = json.loads((out / "eval.json").read_text())
    assert written["results"] == json.loads(json.dumps(report["results"]))
    assert len(list((out / "eval").glob("step_*.json"))) == 1
