"""Vocabulary trimming (``data.trim_vocab``, `mars_jax.vocab`): the id map both ways, a trimmed
run end to end (train, stage 2, generate, evaluate) against mappings done here with plain
dicts, and the refusals (init from a Hugging Face checkpoint, export)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mars_jax import (
    config,
    decode,
    errors,
    evaluate,
    export,
    objectives,
    train,
    train_inputs,
    train_step,
    vocab,
)
from mars_jax import workdir as wd
from mars_jax.batches import batched_dataset, eval_examples
from mars_jax.config import ObjectiveConfig
from mars_jax.tokenizer import (
    DEFAULT_EOS_IDS,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    MASK_ID,
    load_tokenizer,
)
from tests.decode_oracles import qwen_generate
from tests.helpers import complete, tiny_config

CONTROL = {ENDOFTEXT_ID, IM_START_ID, IM_END_ID, MASK_ID}
QWEN_CONTROL = (ENDOFTEXT_ID, IM_START_ID, IM_END_ID)


TRIMMED_RUN = {
    "data.trim_vocab": True,
    "data.num_synthetic_train": 16,
    "train.num_steps": 2,
    "train.batch_size": 4,
    "train.log_every": 1,
    "model.num_layers": 1,
    "model.hidden_size": 32,
    "model.intermediate_size": 64,
    "model.head_dim": 8,
    "eval.num_examples": 3,
    "eval.batch_size": 4,
    "eval.max_new_tokens": 6,
    "eval.thresholds": (1.0, 0.9),
    "eval.nll_examples": 3,
}


def get_config(stage="ar", **extra):
    """configs/tiny.py shrunk to a few seconds per run, trimmed; ``extra`` "a__b" = key "a.b"."""
    return tiny_config(stage, TRIMMED_RUN, **extra)


def saved_ids(workdir):
    with open(os.path.join(workdir, "vocab_map.json")) as f:
        return json.load(f)["qwen_ids"]


# ----------------------------------------------------------------------------------------------
# The map.


def test_map_round_trip_both_ways():
    rng = np.random.default_rng(0)
    kept = np.sort(rng.choice(151666, size=300, replace=False))
    vocab_map = vocab.VocabMap(kept)
    index = {int(q): m for m, q in enumerate(kept)}  # the oracle: a dict
    qwen = rng.choice(kept, size=(3, 7))
    model = vocab_map.to_model(qwen)
    assert model.dtype == np.int32 and model.shape == (3, 7)
    np.testing.assert_array_equal(model, np.vectorize(index.get)(qwen))
    np.testing.assert_array_equal(vocab_map.to_qwen(model), qwen)
    every = np.arange(len(vocab_map))
    np.testing.assert_array_equal(vocab_map.to_model(vocab_map.to_qwen(every)), every)


def test_missing_ids_and_bad_maps_are_refused():
    vocab_map = vocab.VocabMap([3, 10, 42])
    with pytest.raises(ValueError, match=r"^prompt 2: token id 11 is not in the trimmed"):
        vocab_map.to_model([10, 11, 12], "prompt 2")
    assert vocab_map.missing([12, 10, -5, 11, 12, 99]) == [12, -5, 11, 99]  # below, absent, above
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        vocab_map.to_qwen([0, 3])
    for bad in ([3, 3], [5, 4], [-1, 2], []):
        with pytest.raises(ValueError, match="sorted and unique"):
            vocab.VocabMap(bad)


def test_build_keeps_data_controls_mask_and_lowest_fillers():
    data_ids = [np.array([500, 7, 7, 151645]), np.array([[9000, 3], [3, 500]])]
    vocab_map = vocab.build(data_ids, mask_id=151665, vocab_size=151666, control_ids=QWEN_CONTROL)
    needed = {500, 7, 9000, 3} | CONTROL
    fillers = [i for i in range(151666) if i not in needed][: 128 - len(needed)]
    assert vocab_map.ids.tolist() == sorted(needed | set(fillers))
    assert len(vocab_map) == 128
    with pytest.raises(ValueError, match="outside"):
        vocab.build(
            [np.array([151666])], mask_id=151665, vocab_size=151666, control_ids=QWEN_CONTROL
        )


def test_save_and_load(tmp_path):
    vocab_map = vocab.VocabMap([1, 5, 151665])
    vocab_map.save(tmp_path / "m.json")
    assert vocab.VocabMap.load(tmp_path / "m.json").ids.tolist() == [1, 5, 151665]
    (tmp_path / "bad.json").write_text('{"qwen_ids": [5, 1]}')
    with pytest.raises(ValueError, match=r"bad\.json: not a vocabulary map"):
        vocab.VocabMap.load(tmp_path / "bad.json")


def test_mapped_tokenizer_speaks_model_ids():
    tok = load_tokenizer()
    text = "<|im_start|>user\n12 + 30 = 42<|im_end|>"
    qwen = tok.encode(text)
    vocab_map = vocab.build([np.array(qwen)], tok.mask_id, len(tok), control_ids=QWEN_CONTROL)
    mapped = vocab.MappedTokenizer(tok, vocab_map)
    index = {int(q): m for m, q in enumerate(vocab_map.ids)}
    assert mapped.encode(text) == [index[q] for q in qwen]
    assert mapped.encode_batch([text, "42"]) == [
        [index[q] for q in qwen],
        [index[q] for q in tok.encode("42")],
    ]
    assert mapped.decode(mapped.encode(text), skip_special_tokens=False) == text
    assert (mapped.pad_id, mapped.eos_id, mapped.mask_id) == (
        index[ENDOFTEXT_ID],
        index[IM_END_ID],
        index[MASK_ID],
    )
    assert len(mapped) == len(vocab_map)
    assert vocab.model_ids(mapped, [IM_END_ID]) == [index[IM_END_ID]]
    assert vocab.qwen_ids(mapped, [index[IM_END_ID]]) == [IM_END_ID]
    assert vocab.model_ids(tok, [IM_END_ID]) == vocab.qwen_ids(tok, [IM_END_ID]) == [IM_END_ID]
    with pytest.raises(ValueError, match=r"token 'Tom' \(id 24732\) is not in this run's trimmed"):
        mapped.encode("Tom 12")


# ----------------------------------------------------------------------------------------------
# A trimmed run.


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory):
    """A 2-step trimmed stage-1 run from scratch: (workdir, config)."""
    workdir = str(tmp_path_factory.mktemp("runs") / "ar")
    cfg = get_config("ar")
    train.train(cfg, workdir)
    return workdir, cfg


def test_trimmed_run_keeps_the_data_ids(trimmed):
    workdir, cfg = trimmed
    tok = load_tokenizer()
    ids = saved_ids(workdir)
    train_ids = {
        i for e in train_inputs.load_train_examples(cfg, tok) for i in e.input_ids.tolist()
    }
    eval_ids = set()
    for prompt, answer in eval_examples("synthetic", num_examples=3, seed=cfg.seed + 1):
        eval_ids |= set(tok.apply_chat_template(prompt, add_generation_prompt=True))
        eval_ids |= set(tok.encode(answer))
    needed = train_ids | eval_ids | CONTROL
    assert needed <= set(ids) and ids == sorted(set(ids))
    assert len(ids) == -(-len(needed) // 128) * 128  # the rest are filler rows
    with open(os.path.join(workdir, "model.json")) as f:
        assert json.load(f)["vocab_size"] == len(ids)
    model, tok, step = wd.load_model(workdir)
    assert step == 2 and isinstance(tok, vocab.MappedTokenizer)
    assert model.embed_tokens.embedding[...].shape == (len(ids), cfg.model.hidden_size)


def test_stage2_keeps_the_map_and_trains_on_mapped_batches(trimmed, tmp_path):
    stage1, _ = trimmed
    workdir = str(tmp_path / "mars")
    cfg = get_config("mars", init_from=stage1, train__num_steps=1, train__learning_rate=0.0)
    m = train.train(cfg, workdir)
    assert saved_ids(workdir) == saved_ids(stage1)
    # The clean half at step 1 is the stage-1 model's AR loss on the first batch, mapped here
    # with a dict.
    s1, _, _ = wd.load_model(stage1)
    index = {q: i for i, q in enumerate(saved_ids(stage1))}
    to_model = np.vectorize(lambda q: index.get(int(q), q))  # keeps IGNORE_INDEX
    examples = [
        e._replace(
            input_ids=to_model(e.input_ids).astype(np.int32),
            labels=to_model(e.labels).astype(np.int32),
        )
        for e in train_inputs.load_train_examples(cfg, load_tokenizer())
    ]
    batch = batched_dataset(
        examples,
        batch_size=4,
        max_length=cfg.data.max_length,
        seed=cfg.seed,
        pad_id=index[ENDOFTEXT_ID],
    )[0]
    obj = ObjectiveConfig(
        name="ar",
        max_label_tokens=train_step.objective_settings(cfg, 0, examples).max_label_tokens,
        normalization="sequence",
        ce_chunk_size=0,
    )
    ar, _ = objectives.ar_loss(s1, jax.tree.map(jnp.asarray, batch), obj)
    assert m["clean_loss"] == pytest.approx(float(ar), rel=1e-5)


def test_generate_returns_qwen_ids(trimmed):
    workdir, cfg = trimmed
    prompts = [p[-1]["content"] for p, _ in eval_examples("synthetic", num_examples=2, seed=1)]
    results = complete(workdir, prompts, threshold=0.9, max_new_tokens=6)
    # Oracle: decode in model ids, mapping prompts and special ids in and tokens out by hand.
    ids = saved_ids(workdir)
    index = {q: i for i, q in enumerate(ids)}
    tok = load_tokenizer(os.path.join(workdir, "tokenizer"))
    model, _, _ = wd.load_model(workdir)
    prompt_ids = [
        [index[q] for q in tok.apply_chat_template([{"role": "user", "content": p}], True)]
        for p in prompts
    ]
    out = qwen_generate(
        model,
        *decode.pad_prompts(prompt_ids, index[ENDOFTEXT_ID]),
        block_size=4,
        threshold=0.9,
        max_new_tokens=6,
        eos_ids=(index[IM_END_ID], index[ENDOFTEXT_ID]),
        mask_id=index[MASK_ID],
    )
    expected = [[ids[m] for m in row] for row in out.completions()]
    assert [r["tokens"] for r in results] == expected
    assert [r["text"] for r in results] == [tok.decode(e) for e in expected]
    with pytest.raises(ValueError, match=r"token 'Tom' \(id 24732\)"):
        complete(workdir, ["Tom has 3 apples."], max_new_tokens=2)


def test_evaluate_a_trimmed_run(trimmed):
    workdir, cfg = trimmed
    report = evaluate.evaluate(cfg, workdir)
    assert np.isfinite(report["ar_nll"])
    prompts = [p[-1]["content"] for p, _ in eval_examples("synthetic", num_examples=3, seed=1)]
    texts = [r["text"] for r in complete(workdir, prompts, threshold=1.0, max_new_tokens=6)]
    assert [e["completion"] for e in report["results"][0]["examples"]] == texts


def test_stage2_on_other_data_names_the_row_and_the_map(trimmed, tmp_path):
    """Stage 2 keeps stage 1's map, so its training rows must encode in it: a row that does not
    is refused naming the file, the row and whose map it is (was 'training data: token id
    ...', naming neither)."""
    rows = tmp_path / "train.jsonl"
    ((prompt, answer),) = eval_examples("synthetic", num_examples=1, seed=1)
    rows.write_text(
        "".join(
            json.dumps({"question": q, "answer": a}) + "\n"
            for q, a in ((prompt[-1]["content"], answer), ("Café?", answer))
        )
    )
    cfg = get_config(
        "mars",
        init_from=trimmed[0],
        data__source="gsm8k",
        data__train_path=str(rows),
        data__eval_path=str(rows),
    )
    workdir = tmp_path / "mars"
    with pytest.raises(
        ValueError,
        match=rf"^{rows} \(init_from's vocab_map.json\): row 1: "
        r"token id \d+ is not in the trimmed vocabulary",
    ):
        train.train(cfg, str(workdir))
    assert not workdir.exists()


def test_a_step_that_was_not_saved_is_named_with_the_saved_ones(trimmed):
    """--step of a step never saved (was: 'checkpoint step 7: .../7/sha256.json: missing: the
    step cannot be verified (a damaged step, ...)')."""
    with pytest.raises(FileNotFoundError, match=r"no checkpoint step 7 in .*\(saved steps: 2\)"):
        wd.load_model(trimmed[0], step=7)


def test_evaluate_names_the_example_with_a_token_outside_the_vocabulary(trimmed, tmp_path):
    """Evaluation data the run never saw (GSM8K for a synthetic run): the refusal names the
    file and the example, not only the token."""
    rows = tmp_path / "test.jsonl"
    prompts, _ = zip(*eval_examples("synthetic", num_examples=1, seed=1))
    seen = prompts[0][-1]["content"]  # a question the run's vocabulary covers
    rows.write_text(
        "".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in (seen, "Café?"))
    )
    cfg = get_config(
        "ar", data__source="gsm8k", data__train_path=str(rows), data__eval_path=str(rows)
    )
    with pytest.raises(ValueError, match=rf"^{rows}: evaluation example 1: token .* is not in"):
        evaluate.evaluate(cfg, trimmed[0])


# ----------------------------------------------------------------------------------------------
# Refusals.


def test_trim_vocab_refused_with_a_hugging_face_or_untrimmed_init(trimmed, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(errors.SettingError, match=r"^data.trim_vocab=True: .*Hugging Face"):
        config.validate(get_config("mars", init_from=str(hf)), training=True)
    untrimmed = tmp_path / "untrimmed"
    untrimmed.mkdir()
    (untrimmed / "model.json").write_text("{}")
    with pytest.raises(errors.SettingError, match=r"^data.trim_vocab=True: .*untrimmed run"):
        config.validate(get_config("mars", init_from=str(untrimmed)), training=True)
    with pytest.raises(errors.SettingError, match=r"^data.trim_vocab=False: .*trimmed run"):
        config.validate(
            get_config("mars", init_from=trimmed[0], data__trim_vocab=False), training=True
        )
    config.validate(
        get_config("mars", init_from=trimmed[0]), training=True
    )  # a trimmed run continued: fine


def test_export_of_a_trimmed_run_is_refused(trimmed, tmp_path):
    out = tmp_path / "hf_out"
    with pytest.raises(ValueError, match=r"trimmed vocabulary \(\d+ rows.*export is refused"):
        export.export_run(trimmed[0], str(out))
    assert not out.exists()


def _damaged_copy(run, tmp_path, damage):
    """A copy of ``run`` (run files and checkpoints) with ``damage(path of vocab_map.json)``."""
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("lock"))
    damage(os.path.join(copy, "vocab_map.json"))
    return copy


def _write_ids(ids):
    def damage(path):
        with open(path, "w") as f:
            json.dump({"qwen_ids": ids}, f)

    return damage


def _change_one_id(path):
    """One id moved up by one where that keeps the list sorted and unique, the file's sha256
    kept: a map that still reads as a map, of other tokens."""
    with open(path) as f:
        saved = json.load(f)
    ids = saved["qwen_ids"]
    i = next(i for i in range(len(ids) - 1) if ids[i] + 1 < ids[i + 1])
    ids[i] += 1
    with open(path, "w") as f:
        json.dump(saved, f)


@pytest.mark.parametrize(
    "name", ["removed", "truncated", "one_id_short", "past_the_tokenizer", "one_id_changed"]
)
def test_a_damaged_vocab_map_is_refused_naming_the_file(trimmed, tmp_path, name):
    """A trimmed run whose vocab_map.json is gone, unreadable or not the model's is refused by
    every loader (generate, evaluate, the lm_eval adapter and export all go through
    `workdir.load_model`) with a message naming the file, never decoded with shifted or
    untranslated ids (without the map, a 128-row model decoded as Qwen ids: garbage text, and
    export wrote it as a Hugging Face checkpoint)."""
    ids = saved_ids(trimmed[0])
    damage, match = {
        "removed": (os.remove, r"vocab_map.json not found: .* data.trim_vocab=True"),
        "truncated": (
            lambda p: open(p, "w").write('{"qwen_ids": [0, 1'),
            r"vocab_map.json: not a vocabulary map \(Expecting",
        ),
        "one_id_short": (
            _write_ids(ids[1:]),
            rf"vocab_map.json: {len(ids) - 1} ids, but the model \(model.json\) "
            rf"has {len(ids)} embedding rows",
        ),
        "past_the_tokenizer": (
            _write_ids(ids[:-1] + [999_999]),
            r"vocab_map.json: id 999999 lies past the tokenizer's",
        ),
        "one_id_changed": (_change_one_id, r"vocab_map.json: its ids do not match its sha256"),
    }[name]
    copy = _damaged_copy(trimmed[0], tmp_path, damage)
    with pytest.raises(ValueError, match=match):
        wd.load_model(copy)
    out = tmp_path / "hf_out"
    with pytest.raises(ValueError, match="vocab_map.json"):  # refused (as trimmed, or damaged)
        export.export_run(copy, str(out))
    assert not out.exists()


def test_decode_speed_benchmark_speaks_a_trimmed_runs_ids(trimmed):
    """benchmarks/decode_speed.py on a trimmed run: stop, pad and mask ids are the model's
    (Qwen2.5's <|mask|> 151665 lies past the trimmed embedding), and transformers' greedy
    generate on the same weights gives our AR tokens."""
    from benchmarks import decode_speed as ds

    workdir, cfg = trimmed
    (s,) = ds.build_subjects(
        ["trained"], batch_sizes=[2], workdir=workdir, config=cfg, num_prompts=2, max_new_tokens=4
    )
    vocab_map = vocab.VocabMap(saved_ids(workdir))
    assert s.eos_ids == tuple(vocab_map.to_model(list(DEFAULT_EOS_IDS)).tolist())
    assert s.mask_id == int(vocab_map.to_model([MASK_ID])[0]) < len(vocab_map)
    assert s.pad_id == int(vocab_map.to_model([ENDOFTEXT_ID])[0])
    rows = ds.benchmark([s], batch_sizes=[2], thresholds=[0.9], repeats=1)
    by = {r["decoder"]: r for r in rows}
    assert by["transformers"]["same_as_ar"] == 1.0 and by["verify"]["same_as_ar"] == 1.0
