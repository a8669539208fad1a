"""End-to-end tests of the run entry points on the embedded tiny config, shrunk further:
train (stage 1, resume, stage 2 from stage 1, init from a Hugging Face directory), and the
train / evaluate / generate / export command lines."""

import ast
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from mars_jax import evaluate, export, objectives, train, train_inputs, train_step
from mars_jax import workdir as wd
from mars_jax.batches import batched_dataset, eval_examples
from mars_jax.checkpoints import Checkpoints
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.config import ObjectiveConfig
from mars_jax.errors import InputError
from mars_jax.model import CausalLM, ModelConfig, causal_mask
from mars_jax.tokenizer import IM_END_ID, MASK_ID, load_tokenizer
from tests.decode_oracles import qwen_generate
from tests.helpers import complete, python_env, run_python
from tests.train_runs import LR, ROOT, cli_flags, flat_params, get_config


def read_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_same_params(a, b, atol=1e-6):
    pa, pb = flat_params(a), flat_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=0, atol=atol, err_msg=k)


def our_logits(model, ids):
    ids = jnp.asarray(ids, jnp.int32)
    t = ids.shape[1]
    hidden, _ = model(ids, jnp.broadcast_to(jnp.arange(t), ids.shape), causal_mask(t))
    return np.asarray(model.logits(hidden))


def torch_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    """A 4-step stage-1 (AR) run straight through: (workdir, config, returned metrics)."""
    workdir = str(tmp_path_factory.mktemp("runs") / "ar")
    cfg = get_config("ar")
    last = train.train(cfg, workdir)
    return workdir, cfg, last


# ----------------------------------------------------------------------------------------------
# Training runs.


def test_stage1_run_directory(stage1):
    workdir, cfg, last = stage1
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
    metrics = read_metrics(workdir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[-1] == last
    for m in metrics:
        for key in ("loss", "learning_rate", "tokens_per_s", "eta_s", "clean_loss", "grad_norm"):
            assert math.isfinite(m[key]), key
        assert m["tokens_per_s"] > 0 and m["eta_s"] >= 0
        assert "noisy_loss" not in m  # AR objective
    assert metrics[-1]["eta_s"] == 0
    # Warmup of max(1, round(0.03 * 4)) = 1 step from 0, then linear decay to 0 at step 4.
    np.testing.assert_allclose(
        [m["learning_rate"] for m in metrics], [0.0, LR, LR * 2 / 3, LR / 3], rtol=1e-5
    )
    # Random init starts near ln(vocab); training lowers the loss.
    assert abs(metrics[0]["loss"] - math.log(cfg.model.vocab_size)) < 0.5
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.05

    with open(os.path.join(workdir, "model.json")) as f:
        # the config's model section, with the ModelConfig defaults of the keys it leaves out
        assert json.load(f) == dataclasses.asdict(ModelConfig(**cfg.model.to_dict()))
    with open(os.path.join(workdir, "config.json")) as f:
        saved = json.load(f)
    assert saved["train"]["num_steps"] == 4 and saved["objective"]["name"] == "ar"
    assert list(saved["eval"]["thresholds"]) == [1.0, 0.9]
    tok = load_tokenizer(os.path.join(workdir, "tokenizer"))
    assert tok.mask_id == MASK_ID and len(tok) == 151666

    model, _, step = wd.load_model(workdir)
    assert step == 4
    first, _, _ = wd.load_model(workdir, step=2)
    p4, p2 = flat_params(model), flat_params(first)
    assert any(not np.array_equal(p4[k], p2[k]) for k in p4)  # steps 3-4 changed the params


class _Interrupted(Exception):
    pass


def interrupt_after_save(monkeypatch, cfg, workdir: str, step: int) -> None:
    """Trains ``cfg`` in ``workdir`` and kills the run right after its step-``step`` checkpoint
    is written (an exception out of the save), as a crash would."""
    real_save = Checkpoints.save

    def save_then_die(self, at, state):
        real_save(self, at, state)
        if at == step:
            self.close()
            raise _Interrupted

    monkeypatch.setattr(Checkpoints, "save", save_then_die)
    with pytest.raises(_Interrupted):
        train.train(cfg, workdir)
    monkeypatch.undo()


def test_resume_equals_uninterrupted_run(stage1, tmp_path, monkeypatch):
    """Kill the run right after its step-2 checkpoint is written, restart it in the same
    workdir: the final parameters and logged losses equal those of the straight 4-step run."""
    straight, cfg, _ = stage1
    workdir = str(tmp_path / "resumed")
    interrupt_after_save(monkeypatch, get_config("ar"), workdir, step=2)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"]
    assert [m["step"] for m in read_metrics(workdir)] == [1, 2]

    train.train(get_config("ar"), workdir)
    resumed, expected = read_metrics(workdir), read_metrics(straight)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for r, e in zip(resumed, expected):
        for key in ("loss", "grad_norm", "learning_rate", "label_tokens"):
            assert r[key] == pytest.approx(e[key], rel=1e-6, abs=1e-7), (r["step"], key)
    a, _, step_a = wd.load_model(workdir)
    b, _, step_b = wd.load_model(straight)
    assert step_a == step_b == 4
    assert_same_params(a, b)


# Preemption runs: enough steps that a signal sent once step 1 is logged lands mid-run, no
# regular save before the end (the only checkpoint before it is the preemption's).
PREEMPT_STEPS = 8
PREEMPT_FLAGS = [f"--config.train.num_steps={PREEMPT_STEPS}", "--config.train.save_every=1000"]


def train_cli(workdir):
    return [
        sys.executable,
        "-m",
        "mars_jax.train",
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        *cli_flags(),
        *PREEMPT_FLAGS,
    ]


def interrupt(workdir, sig, when="metrics.jsonl", timeout=120):
    """Starts the train command, sends ``sig`` once the file ``when`` of the workdir is not
    empty (metrics.jsonl: after the first step; config.json: during the setup, before anything
    is compiled), waits for it to exit: returns (exit code, stderr)."""
    proc = subprocess.Popen(
        train_cli(workdir),
        cwd=ROOT,
        env=python_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    marker, deadline = os.path.join(workdir, when), time.time() + timeout
    try:
        while not (os.path.exists(marker) and os.path.getsize(marker) > 0):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline, "no step logged"
            time.sleep(0.02)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stderr


@pytest.fixture(scope="module")
def straight_preempt_run(tmp_path_factory):
    """The PREEMPT_STEPS-step run straight through (in-process): its workdir."""
    workdir = str(tmp_path_factory.mktemp("runs") / "straight")
    train.train(get_config("ar", train__num_steps=PREEMPT_STEPS, train__save_every=1000), workdir)
    return workdir


def stop_by_signal(workdir, sig, when="metrics.jsonl") -> int:
    """Interrupts the train command in ``workdir`` with ``sig`` (see `interrupt`) and checks
    the stop: exit 0, no traceback, one line naming the saved step, a checkpoint of that step
    only (with its data position). Returns the saved step."""
    code, stderr = interrupt(workdir, sig, when)
    # SIGTERM (a preemption notice): 0, as the job is done for now; Ctrl-C: the shell's 130, so
    # that a pipeline (launch/two_stage.sh) stops too.
    assert code == (130 if sig == signal.SIGINT else 0), stderr[-3000:]
    assert "Traceback" not in stderr
    assert "starting a fresh run" in stderr
    lines = [l for l in stderr.splitlines() if "rerun the same command to resume" in l]
    assert len(lines) == 1, stderr[-3000:]
    steps = os.listdir(os.path.join(workdir, "checkpoints"))
    assert len(steps) == 1, steps
    saved = int(steps[0])
    assert 1 <= saved < PREEMPT_STEPS
    assert f"stopped by {sig.name}: saved step {saved} of {PREEMPT_STEPS} in {workdir};" in lines[0]
    with open(os.path.join(workdir, "checkpoints", steps[0], "data", "metadata")) as f:
        assert json.load(f) == {"next_batch": saved}
    return saved


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigterm_saves_the_step_and_the_rerun_resumes(straight_preempt_run, tmp_path):
    """SIGTERM to `python -m mars_jax.train` after its first step stops it (see
    `stop_by_signal`); the same command then resumes from the saved step and ends with the
    straight run's parameters, bitwise."""
    workdir = str(tmp_path / "run")
    saved = stop_by_signal(workdir, signal.SIGTERM)
    proc = run_python(*train_cli(workdir)[1:])
    assert f"resuming {workdir} from its checkpoint of step {saved}" in proc.stderr
    a, _, step_a = wd.load_model(workdir)
    b, _, step_b = wd.load_model(straight_preempt_run)
    assert step_a == step_b == PREEMPT_STEPS
    assert_same_params(a, b, atol=0)


@pytest.mark.subprocess
def test_sigint_during_setup_saves_the_first_step(tmp_path):
    """Ctrl-C (SIGINT) stops the run the same way (resuming is the SIGTERM test's), also when it
    comes during the setup, before the first step: the run stops after step 1 and saves it."""
    assert stop_by_signal(str(tmp_path / "run"), signal.SIGINT, when="config.json") == 1


def test_stage2_starts_from_stage1(stage1, tmp_path):
    stage1_dir, _, _ = stage1
    workdir = str(tmp_path / "mars")
    # learning rate 0: one step must leave the stage-1 parameters untouched. The model section
    # is ignored with init_from (the workdir's model.json wins), so give it a different depth.
    cfg = get_config(
        "mars",
        init_from=stage1_dir,
        train__num_steps=1,
        train__learning_rate=0.0,
        model__num_layers=3,
    )
    last = train.train(cfg, workdir)
    with (
        open(os.path.join(workdir, "model.json")) as f,
        open(os.path.join(stage1_dir, "model.json")) as g,
    ):
        assert json.load(f) == json.load(g)
    s1, tok, _ = wd.load_model(stage1_dir)
    s2, _, _ = wd.load_model(workdir)
    assert_same_params(s1, s2, atol=0)
    assert load_tokenizer(os.path.join(workdir, "tokenizer")).mask_id == MASK_ID

    (m,) = read_metrics(workdir)
    assert m == last
    for key in (
        "step",
        "loss",
        "noisy_loss",
        "clean_loss",
        "learning_rate",
        "tokens_per_s",
        "eta_s",
    ):
        assert key in m and math.isfinite(m[key]), key
    assert m["loss"] == pytest.approx(m["noisy_loss"] + cfg.objective.ar_weight * m["clean_loss"])
    # The clean half of MARS is the AR loss: at step 1 it is the stage-1 model's AR loss on the
    # first batch, which a fresh random model would not give.
    examples = train_inputs.load_train_examples(cfg, tok)
    batch = batched_dataset(
        examples, batch_size=cfg.train.batch_size, max_length=cfg.data.max_length, seed=cfg.seed
    )[0]
    obj = ObjectiveConfig(
        name="ar",
        max_label_tokens=train_step.objective_settings(cfg, tok.mask_id, examples).max_label_tokens,
        normalization=cfg.objective.normalization,
        ce_chunk_size=0,
    )
    ar, _ = objectives.ar_loss(s1, jax.tree.map(jnp.asarray, batch), obj)
    assert m["clean_loss"] == pytest.approx(float(ar), rel=1e-5)


def test_inverse_t_weighting_reaches_the_step(stage1, tmp_path):
    """objective.noisy_weighting=inverse_t in a real run: the first step's loss (learning rate 0,
    from stage 1) is the noisy CE weighted by `noisy_row_weights(seed, 0, batch_size)`, whole
    or in two micro-batches."""
    stage1_dir, _, _ = stage1
    s1, tok, _ = wd.load_model(stage1_dir)
    losses = []
    for accum in (1, 2):
        cfg = get_config(
            "mars",
            init_from=stage1_dir,
            train__num_steps=1,
            train__learning_rate=0.0,
            objective__ar_weight=0.0,
            objective__noisy_weighting="inverse_t",
            train__grad_accum_steps=accum,
        )
        losses.append(train.train(cfg, str(tmp_path / f"accum{accum}"))["loss"])
    examples = train_inputs.load_train_examples(cfg, tok)
    batch = batched_dataset(
        examples, batch_size=cfg.train.batch_size, max_length=cfg.data.max_length, seed=cfg.seed
    )[0]
    obj = train_step.objective_settings(cfg, tok.mask_id, examples)
    weights = objectives.noisy_row_weights(cfg.seed, 0, cfg.train.batch_size)
    expected, _ = objectives.mars_loss(s1, {**batch, objectives.NOISY_WEIGHT: weights}, obj)
    unweighted, _ = objectives.mars_loss(
        s1,
        batch,
        dataclasses.replace(obj, noisy_weighting="none"),  # ObjectiveConfig is frozen
    )
    assert losses == pytest.approx([float(expected)] * 2, rel=1e-5)
    assert abs(float(expected) - float(unweighted)) > 0.1 * float(unweighted)


def make_hf_checkpoint(path):
    """A random transformers Qwen2 (real special-token rows) with non-trivial biases and norms,
    saved with save_pretrained, plus the offline tokenizer files (as a release ships them)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151680,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    model.eval()
    model.save_pretrained(str(path))
    load_tokenizer(None).save(str(path))
    return model


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """(transformers model, workdir of a 1-step run at learning rate 0 initialised from it)."""
    root = tmp_path_factory.mktemp("hf")
    hf = make_hf_checkpoint(root / "hf")
    workdir = str(root / "from_hf")
    cfg = get_config("ar", init_from=str(root / "hf"), train__num_steps=1, train__learning_rate=0.0)
    last = train.train(cfg, workdir)
    assert math.isfinite(last["loss"])
    return hf, workdir


def test_init_from_hf_directory(hf_run):
    hf, workdir = hf_run
    with open(os.path.join(workdir, "model.json")) as f:
        model_json = json.load(f)
    assert (model_json["vocab_size"], model_json["hidden_size"], model_json["rope_theta"]) == (
        151680,
        32,
        5000.0,
    )
    model, tok, _ = wd.load_model(workdir)
    assert tok.mask_id == MASK_ID
    ids = np.random.default_rng(0).integers(0, 151680, size=(2, 12))
    np.testing.assert_allclose(our_logits(model, ids), torch_logits(hf, ids), atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(
        flat_params(model)["['embed_tokens']['embedding']"],
        hf.model.embed_tokens.weight.detach().numpy(),
    )


# ----------------------------------------------------------------------------------------------
# Command lines.


@pytest.mark.subprocess
def test_cli_rejects_unknown_config_key(tmp_path):
    workdir = tmp_path / "never"
    proc = run_python(
        "-m",
        "mars_jax.train",
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        "--config.train.nope=1",
        check=False,
    )
    assert proc.returncode != 0
    assert "nope" in proc.stderr
    assert not workdir.exists()


@pytest.fixture(scope="module")
def evaluation(stage1):
    """The in-process evaluation of the stage-1 run: (report returned, eval.json as written)."""
    workdir, cfg, _ = stage1
    report = evaluate.evaluate(cfg, workdir)
    with open(os.path.join(workdir, "eval.json")) as f:
        return report, json.load(f)


def test_evaluate_in_process(stage1, evaluation):
    workdir, cfg, _ = stage1
    report, written = evaluation
    assert written == report
    assert report["step"] == 4 and report["num_examples"] == 4 and report["block_size"] == 4
    assert [r["threshold"] for r in report["results"]] == [1.0, 0.9]
    for r in report["results"]:
        for key in (
            "accuracy",
            "tokens_per_forward",
            "tokens_per_s",
            "mean_length",
            "agreement_with_ar",
        ):
            assert math.isfinite(r[key]), key
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["agreement_with_ar"] <= 1
        assert r["tokens_per_forward"] >= 1 and r["tokens_per_s"] > 0
        assert 0 <= r["mean_length"] <= 8
    one = report["results"][0]
    assert one["agreement_with_ar"] == 1.0 and one["tokens_per_forward"] == 1.0

    # Recompute threshold 1.0 and the NLL independently from the checkpoint.
    model, tok, _ = wd.load_model(workdir)
    examples = eval_examples("synthetic", num_examples=4, fmt="gsm8k", seed=cfg.seed + 1)
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m, _ in examples]
    ids = np.full((4, max(map(len, prompts))), tok.pad_id, np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    out = qwen_generate(
        model,
        ids,
        np.asarray([len(p) for p in prompts]),
        block_size=4,
        threshold=1.0,
        max_new_tokens=8,
    )
    assert one["mean_length"] == pytest.approx(np.mean(out.lengths))

    # Teacher-forced NLL of answer + <|im_end|> after the prompt, sequences cut at max_length.
    max_length = cfg.data.max_length
    seqs = [
        (p + tok.encode(answer) + [IM_END_ID])[:max_length]
        for (_, answer), p in zip(examples, prompts)
    ]
    batch = np.zeros((4, max_length), np.int32)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    hidden, _ = model(jnp.asarray(batch), jnp.arange(max_length)[None], causal_mask(max_length))
    nll = []
    for i, (s, p) in enumerate(zip(seqs, prompts)):
        logp = jax.nn.log_softmax(model.logits(hidden[i, len(p) - 1 : len(s) - 1]), axis=-1)
        nll += (-np.asarray(logp)[np.arange(len(s) - len(p)), s[len(p) :]]).tolist()
    assert len(nll) > 4 * 8
    assert report["ar_nll"] == pytest.approx(np.mean(nll), rel=1e-4)


@pytest.mark.subprocess
def test_evaluate_cli_writes_the_in_process_report(stage1, evaluation):
    workdir, _, _ = stage1
    run_python(
        "-m", "mars_jax.evaluate", "--config=configs/tiny.py", f"--workdir={workdir}", *cli_flags()
    )
    with open(os.path.join(workdir, "eval.json")) as f:
        cli_report = json.load(f)
    expected = evaluation[0]
    for r in [cli_report, expected] + cli_report["results"] + expected["results"]:
        for key in evaluate.WALL_CLOCK_KEYS:
            r.pop(key, None)
    assert cli_report == expected


@pytest.mark.subprocess
def test_entry_modules_import_together():
    """Flags are defined only when a module runs as a program: every module of the package and
    the benchmark import into one process (absl would raise DuplicateFlagError otherwise)."""
    code = (
        "import pkgutil, importlib, mars_jax\n"
        "names = [m.name for m in pkgutil.iter_modules(mars_jax.__path__)]\n"
        "for n in names: importlib.import_module('mars_jax.' + n)\n"
        "import benchmarks.decode_speed\n"
        "from absl import flags\n"
        "assert 'config' not in flags.FLAGS and 'workdir' not in flags.FLAGS\n"
        "print(sorted(names))\n"
    )
    proc = run_python("-c", code)
    for name in ("train", "evaluate", "generate", "export", "train_step", "huggingface"):
        assert f"'{name}'" in proc.stdout


@pytest.mark.subprocess
def test_generate_in_process_and_cli(stage1, tmp_path):
    workdir, _, _ = stage1
    questions = ["What is 12 * 7?", "Tom has 3 apples and buys 4 more. How many now?"]
    results = complete(workdir, questions, threshold=0.9, max_new_tokens=8)
    model, tok, _ = wd.load_model(workdir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], True) for q in questions]
    ids = np.full((2, max(map(len, prompts))), tok.pad_id, np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    expected = qwen_generate(
        model,
        ids,
        np.asarray([len(p) for p in prompts]),
        block_size=4,
        threshold=0.9,
        max_new_tokens=8,
    )
    assert len(results) == 2
    for i, (obj, q) in enumerate(zip(results, questions)):
        assert obj["prompt"] == q
        assert obj["text"] == tok.decode(obj["tokens"])
        assert obj["tokens"] == expected.tokens[i, : expected.lengths[i]].tolist()
        assert obj["tokens_per_forward"] == pytest.approx(
            expected.accepted[i] / expected.row_forwards[i]
        )
        assert len(obj["tokens"]) <= 8

    proc = run_python(
        "-m",
        "mars_jax.generate",
        f"--workdir={workdir}",
        *[f"--prompt={q}" for q in questions],
        "--threshold=0.9",
        "--max_new_tokens=8",
        "--json",
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert [json.loads(line) for line in lines] == results

    # Streaming in process: the chunks of each row add up to its text, in decoder order.
    chunks = []
    streamed = complete(
        workdir,
        questions,
        threshold=[0.9, 1.0],
        max_new_tokens=8,
        cache_mode="block",
        stream=lambda row, text: chunks.append((row, text)),
    )
    assert streamed[0]["tokens"] == results[0]["tokens"]  # block mode, same greedy tokens here
    for i, obj in enumerate(streamed):
        assert "".join(t for r, t in chunks if r == i) == obj["text"]
    # The CLI with a prompts file (the second row brings its own threshold) and --stream.
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(
        json.dumps({"prompt": questions[0]})
        + "\n"
        + json.dumps({"prompt": questions[1], "threshold": 1.0})
        + "\n"
    )
    proc = run_python(
        "-m",
        "mars_jax.generate",
        f"--workdir={workdir}",
        f"--prompts_file={prompts_file}",
        "--threshold=0.9",
        "--max_new_tokens=8",
        "--cache_mode=block",
        "--stream",
    )
    cli_chunks = [line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith("[")]
    for i, obj in enumerate(streamed):
        text = "".join(ast.literal_eval(t) for r, t in cli_chunks if r == f"[{i}]")
        assert text == obj["text"]
    prompts_file.write_text(json.dumps({"prompt": 7}) + "\n")
    proc = run_python(
        "-m",
        "mars_jax.generate",
        f"--workdir={workdir}",
        f"--prompts_file={prompts_file}",
        check=False,
    )
    assert proc.returncode != 0 and f"{prompts_file}: row 1: 'prompt'" in proc.stderr


@pytest.mark.subprocess
def test_export_cli_loads_in_transformers(hf_run, tmp_path):
    # The run initialised from a perturbed HF model: O(1) logits, non-zero biases.
    original, workdir = hf_run
    out = tmp_path / "hf_export"
    run_python("-m", "mars_jax.export", f"--workdir={workdir}", f"--output={out}")
    # The library call writes the same weights and config.
    assert export.export_run(workdir, str(tmp_path / "in_process")) == 1
    files = (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    )
    for name in files:
        assert (out / name).read_bytes() == (tmp_path / "in_process" / name).read_bytes(), name
    config = json.loads((out / "config.json").read_text())
    assert (config["mask_token_id"], config["mars_block_size"]) == (MASK_ID, 4)  # configs/tiny.py
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    model, tok, _ = wd.load_model(workdir)
    ids = np.random.default_rng(1).integers(0, 151666, size=(2, 10))
    ours = our_logits(model, ids)
    assert ours.std() > 0.3
    np.testing.assert_allclose(torch_logits(hf, ids), ours, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(torch_logits(hf, ids), torch_logits(original, ids), atol=1e-4)
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    assert hf_tok.convert_tokens_to_ids("<|mask|>") == hf_tok.mask_token_id == MASK_ID
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    encoded = hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert list(encoded["input_ids"]) == tok.apply_chat_template(messages, True)
    text = "Tom has 12 apples. <|mask|> He gives 5 away."
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)


def test_resume_refuses_a_changed_config(stage1):
    """Resuming a workdir with another batch size (or stage) would silently mix two runs."""
    workdir, _, _ = stage1
    before = open(os.path.join(workdir, "config.json")).read()
    with pytest.raises(ValueError, match=r"train\.batch_size: 4 -> 8"):
        train.train(get_config("ar", train__batch_size=8), workdir)
    with pytest.raises(ValueError, match=r"objective\.name: 'ar' -> 'mars'"):
        train.train(get_config("mars"), workdir)
    assert open(os.path.join(workdir, "config.json")).read() == before  # nothing rewritten
    # The eval section configures evaluation only: a run resumes (here: is complete) with another.
    assert train.train(get_config("ar", eval__num_examples=8), workdir) == {}


@pytest.mark.subprocess
def test_help_lists_the_program_flags():
    for module, names in [
        ("mars_jax.train", ("--config", "--workdir")),
        ("mars_jax.evaluate", ("--config", "--workdir", "--step")),
        ("mars_jax.generate", ("--workdir", "--prompt", "--threshold")),
    ]:
        proc = run_python("-m", module, "--help", check=False)  # absl's --help exits 1
        for name in names:
            assert name in proc.stdout, (module, name)


def test_grad_accumulation_equals_whole_batch():
    """Micro-batches with different label counts: the accumulated update equals the update on
    the whole batch, for both normalizations."""
    cfg = get_config("ar")
    model_cfg = train_inputs.model_config(cfg)
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 1000, (4, 16)).astype(np.int32)
    labels = np.full_like(ids, IGNORE_INDEX)
    for row, start in enumerate([2, 12, 5, 14]):  # 14, 4, 11 and 2 labelled tokens
        labels[row, start:] = ids[row, start:]
    batch = {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(labels)}
    graphdef, params = nnx.split(CausalLM(model_cfg, rngs=nnx.Rngs(0)))
    for norm in ("token", "sequence"):
        obj = ObjectiveConfig(
            name="ar",
            normalization=norm,
            max_label_tokens=None,
            ce_chunk_size=0,
            noisy_weighting="none",
        )
        tx, _ = train_step.optimizer(cfg, 10)
        results = []
        for accum in (1, 2):
            step = jax.jit(train_step.make_train_step(graphdef, tx, obj, accum))
            new_params, _, metrics = step(params, tx.init(params), batch)
            results.append((jax.tree.leaves(new_params), metrics))
        (p1, m1), (p2, m2) = results
        assert float(m1["loss"]) == pytest.approx(float(m2["loss"]), rel=1e-5)
        assert float(m1["grad_norm"]) == pytest.approx(float(m2["grad_norm"]), rel=1e-4)
        for a, b in zip(p1, p2):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_stage2_refuses_a_stage1_stopped_early(tmp_path, monkeypatch):
    """A stage 1 stopped at step 2 of 4 (a signal) is no init_from (unless allowed); once it
    is finished, a stage 2 started from its step 2 is no longer resumed silently."""
    stage1_dir, stage2_dir = str(tmp_path / "ar"), str(tmp_path / "mars")
    stop_at = {"step": 2}
    monkeypatch.setattr(train.Preemption, "stop", lambda self, done: done == stop_at["step"])
    last = train.train(get_config("ar", train__num_steps=4), stage1_dir)
    assert "stopped_by" in last and last["step"] == 2 and not wd.is_complete(stage1_dir)
    stage2 = get_config("mars", init_from=stage1_dir, train__num_steps=2)
    with pytest.raises(InputError, match="has not reached its final step"):
        train.train(stage2, stage2_dir)
    assert not os.path.exists(stage2_dir)
    # Allowed: stage 2 starts from step 2.
    stop_at["step"] = None
    partial = get_config("mars", init_from=stage1_dir, train__num_steps=2)
    partial.train.allow_partial_init = True
    train.train(partial, stage2_dir)
    assert wd.read_init_record(stage2_dir) == {"init_from": stage1_dir, "step": 2}
    train.train(get_config("ar", train__num_steps=4), stage1_dir)  # stage 1 finishes
    assert wd.is_complete(stage1_dir)
    with pytest.raises(InputError, match="started from step 2 of .*, which now holds step 4"):
        train.train(stage2, stage2_dir)


@pytest.mark.subprocess
def test_ctrl_c_in_a_command_is_one_line_and_status_130():
    code = "from mars_jax import cli; cli.run(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))"
    proc = run_python("-c", code, check=False)
    assert proc.returncode == 130 and proc.stderr.strip().splitlines() == ["interrupted"]


# ----------------------------------------------------------------------------------------------
# Packed training (data.packing).

# Chat rows of very different lengths: one-word answers beside long ones.
PACKING_ROWS = [
    ("What is 2 + 3?", "5"),
    ("Name a colour.", "Blue. " * 40),
    ("Count to twenty.", " ".join(str(i) for i in range(1, 21))),
    ("Say hi.", "Hi!"),
    (
        "Spell cat backwards, then explain how you did it step by step.",
        "tac. " + "I read it. " * 15,
    ),
    ("Is ice cold?", "Yes."),
]


def packing_config(tmp_path, stage, **extra):
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            )
            + "\n"
            for q, a in PACKING_ROWS
        )
    )
    return get_config(
        stage,
        data__source="messages",
        data__train_path=str(path),
        data__eval_path=str(path),
        data__max_length=192,
        train__num_steps=1,
        **extra,
    )


@pytest.mark.parametrize("stage", ["ar", "mars"])
def test_a_packed_step_logs_the_loss_of_its_rows_unpacked(tmp_path, stage):
    """One step over every row, packed into fewer sequences, logs the loss, labelled tokens and
    row count of one step over the same rows unpacked."""
    cfg = packing_config(tmp_path, stage, train__batch_size=len(PACKING_ROWS))
    examples = train_inputs.load_train_examples(cfg, load_tokenizer(None))
    assert len(examples) == len(PACKING_ROWS)
    sequences = train_inputs.pack_examples(
        packing_config(tmp_path, stage, data__packing=True), examples
    )
    assert len(sequences) < len(examples)
    packed = packing_config(tmp_path, stage, data__packing=True, train__batch_size=len(sequences))
    logged = {}
    for name, c in (("unpacked", cfg), ("packed", packed)):
        train.train(c, str(tmp_path / name))
        (logged[name],) = read_metrics(str(tmp_path / name))
    a, b = logged["packed"], logged["unpacked"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["label_tokens"] == b["label_tokens"] and a["rows"] == b["rows"] == len(examples)
    if stage == "mars":
        assert a["noisy_loss"] == pytest.approx(b["noisy_loss"], rel=1e-5)
    # The packed run fed fewer tokens of padding through the model.
    assert a["tokens_per_s"] > 0 and b["tokens_per_s"] > 0


def test_packed_resume_equals_uninterrupted_run(tmp_path, monkeypatch):
    """As test_resume_equals_uninterrupted_run, packed (synthetic rows at twice their length:
    two rows a sequence): the resumed run rebuilds the same packing and ends bitwise equal."""
    cfg = lambda: get_config("ar", data__packing=True, data__max_length=256)  # noqa: E731
    straight = str(tmp_path / "straight")
    train.train(cfg(), straight)
    workdir = str(tmp_path / "resumed")
    interrupt_after_save(monkeypatch, cfg(), workdir, step=2)
    train.train(cfg(), workdir)
    resumed, expected = read_metrics(workdir), read_metrics(straight)
    assert [m["loss"] for m in resumed] == [m["loss"] for m in expected]
    assert all(m["rows"] > 4 for m in resumed)  # 4 sequences a step, more rows
    a, _, _ = wd.load_model(workdir)
    b, _, _ = wd.load_model(straight)
    assert_same_params(a, b, atol=0)


def test_packing_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="objective.max_label_tokens"):
        train.train(
            get_config(
                "ar", data__packing=True, data__max_length=256, objective__max_label_tokens=96
            ),
            str(tmp_path / "cap"),
        )
    with pytest.raises(ValueError, match="data.packing=False"):
        train.train(
            get_config("mars", data__packing=True, objective__noisy_weighting="inverse_t"),
            str(tmp_path / "weights"),
        )


def test_stop_at_then_on_equals_a_straight_run(stage1, tmp_path):
    """train.stop_at=2 saves step 2 and stops (the run not complete, a rerun at stop_at=2 does
    nothing); the same command with stop_at=0 goes on to the end, bitwise the straight run."""
    straight, _, _ = stage1
    workdir = str(tmp_path / "segments")
    last = train.train(get_config("ar", train__stop_at=2), workdir)
    assert last["stopped_by"] == "stop_at" and last["step"] == 2
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"]
    assert not wd.is_complete(workdir)
    assert train.train(get_config("ar", train__stop_at=2), workdir) == {"stopped_by": "stop_at"}
    train.train(get_config("ar"), workdir)
    assert wd.is_complete(workdir)
    assert [m["loss"] for m in read_metrics(workdir)] == [m["loss"] for m in read_metrics(straight)]
    a, _, _ = wd.load_model(workdir)
    b, _, _ = wd.load_model(straight)
    assert_same_params(a, b, atol=0)


def test_constant_schedule_holds_the_peak_after_warmup():
    cfg = get_config("ar", train__schedule="constant", train__warmup_ratio=0.25)
    _, schedule = train_step.optimizer(cfg, 8)
    assert [float(schedule(i)) for i in range(8)] == pytest.approx([0.0, LR / 2] + [LR] * 6)
    _, linear = train_step.optimizer(get_config("ar", train__warmup_ratio=0.25), 8)
    assert float(linear(7)) < LR / 2


def test_a_run_trained_with_splash_is_evaluated_anywhere(stage1, tmp_path):
    """The paper configs train with the TPU splash kernel; their runs are read with dense
    attention (a CPU has no splash), so evaluation's teacher-forced NLL runs here and equals
    the same run's read as trained with xla."""
    import shutil

    workdir, cfg, _ = stage1
    copy = tmp_path / "splash_run"
    shutil.copytree(workdir, copy)
    saved = json.loads((copy / "model.json").read_text())
    (copy / "model.json").write_text(json.dumps({**saved, "attention": "splash", "remat": "full"}))
    model, _, _ = wd.load_model(str(copy))
    assert (model.cfg.attention, model.cfg.remat) == ("xla", "none")
    c = get_config("ar", eval__thresholds=(1.0,))
    a = evaluate.evaluate(c, str(copy))["ar_nll"]
    plain = tmp_path / "xla_run"  # a copy: evaluate writes its report into the run
    shutil.copytree(workdir, plain)
    b = evaluate.evaluate(c, str(plain))["ar_nll"]
    assert a == b


def test_the_first_step_says_it_is_done_before_the_first_record(tmp_path, caplog):
    """With train.log_every beyond the first steps, step 1 still logs a line (a user saw
    nothing for 110 s); the metrics records stay at log_every and the last step."""
    import logging

    caplog.set_level(logging.INFO)
    workdir = str(tmp_path / "quiet")
    train.train(get_config("ar", train__num_steps=3, train__log_every=5), workdir)
    first = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1 done")]
    assert len(first) == 1 and first[0].endswith("metrics every 5 steps")
    assert [m["step"] for m in read_metrics(workdir)] == [3]
