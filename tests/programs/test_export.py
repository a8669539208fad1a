"""What an export tells downstream tools (`huggingface.export_hf`, `export.export_run`).

A model with Qwen2.5's 151,936-row vocabulary (and tiny layers): transformers' ``generate``
on the export, given nothing but ``max_new_tokens``, decodes greedily and stops where
`mars_jax.decode.generate` does in AR mode (block size 1, threshold 1.0), at either stop id;
the exported tokenizer declares <|mask|> as its mask token; config.json records the mask id
and the run's block size without breaking transformers' or our own loading.
"""

import json
import os
import shutil
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import yaml
from flax import nnx
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_jax import evaluate, export, huggingface, sharding
from mars_jax import workdir as wd
from mars_jax.checkpoints import Checkpoints, TrainState
from mars_jax.tokenizer import (
    DEFAULT_EOS_IDS,
    ENDOFTEXT_ID,
    IM_END_ID,
    MASK_ID,
    MASK_TOKEN,
    load_tokenizer,
)
from tests.base import test_plots as test_eval_plot
from tests.decode_oracles import qwen_generate, swap_head_columns
from tests.helpers import hf_logits, save_hf

# The offline Qwen2.5 tokenizer's ids, as export_run passes its run tokenizer's.
QWEN_SPECIAL = huggingface.token_ids(load_tokenizer(None))

QWEN_VOCAB = dict(
    vocab_size=151936,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=False,
)
BUDGET = 16


@pytest.fixture(scope="module")
def qwen_vocab(tmp_path_factory):
    """(our model, transformers model) of an untied tiny Qwen2 with Qwen2.5's vocabulary."""
    path = tmp_path_factory.mktemp("qwen_vocab")
    hf = save_hf(path, seed=7, **QWEN_VOCAB)
    return huggingface.load_hf(str(path)), hf


def _ar(model, prompt):
    """Our AR greedy decode of one prompt: (completion ids before any stop id, its length)."""
    out = qwen_generate(
        model,
        np.asarray([prompt]),
        np.asarray([len(prompt)]),
        block_size=1,
        threshold=1.0,
        max_new_tokens=BUDGET,
    )
    return out.tokens[0, : out.lengths[0]].tolist(), int(out.lengths[0])


def test_generate_on_the_export_stops_where_our_decoder_stops(qwen_vocab, tmp_path):
    model, _ = qwen_vocab
    prompt = [11, 2024, 30, 7, 999, 5]
    plain, length = _ar(model, prompt)
    assert length == BUDGET  # the plain continuation runs to the budget
    # Make the greedy continuation emit <|endoftext|> at position k: the head column of the
    # token predicted there (which occurs nowhere before it) trades places with 151643's, so
    # every earlier prediction is unchanged.
    k = next(i for i in range(4, BUDGET) if plain[i] not in plain[:i] + prompt)
    stopped = swap_head_columns(model, plain[k], ENDOFTEXT_ID)
    ours, length = _ar(stopped, prompt)
    assert (ours, length) == (plain[:k], k)
    out = tmp_path / "export"
    huggingface.export_hf(stopped, str(out), special_ids=QWEN_SPECIAL)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [IM_END_ID, ENDOFTEXT_ID] == list(DEFAULT_EOS_IDS)
    assert (generation["pad_token_id"], generation["do_sample"]) == (ENDOFTEXT_ID, False)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=BUDGET)[0].tolist()
    # transformers keeps the stop token it emitted; ours cuts before it.
    assert ids == prompt + ours + [ENDOFTEXT_ID]
    # At <|im_end|> too (transformers' default from config.json alone).
    stopped = swap_head_columns(model, plain[k], IM_END_ID)
    ours, length = _ar(stopped, prompt)
    assert length == k
    huggingface.export_hf(stopped, str(tmp_path / "im_end"), special_ids=QWEN_SPECIAL)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "im_end"), dtype=torch.float32)
    with torch.no_grad():
        ids = hf.eval().generate(torch.tensor([prompt]), max_new_tokens=BUDGET)[0].tolist()
    assert ids == prompt + ours + [IM_END_ID]


def test_no_generation_config_without_the_qwen_vocabulary(tied_ckpt, tmp_path):
    # The stop ids would not be rows of a 96-row embedding.
    huggingface.export_hf(huggingface.load_hf(str(tied_ckpt[0])), str(tmp_path / "small"))
    assert not (tmp_path / "small" / "generation_config.json").exists()
    config = json.loads((tmp_path / "small" / "config.json").read_text())
    assert "mask_token_id" not in config and "eos_token_id" not in config
    with pytest.raises(ValueError, match=r"mask_token_id 151665 is not a row of the 96-row"):
        huggingface.export_hf(
            huggingface.load_hf(str(tied_ckpt[0])), str(tmp_path / "bad"), mask_token_id=MASK_ID
        )


@pytest.fixture(scope="module")
def run_dir(qwen_vocab, tmp_path_factory):
    """A run directory holding the model as checkpoint step 3 of a MARS run trained with block
    size 6 and ar_weight 0.5 (its files written as `mars_jax.train` writes them, without
    training)."""
    model, _ = qwen_vocab
    workdir = str(tmp_path_factory.mktemp("run"))
    run_config = {
        "init_from": "runs/stage1",
        "objective": {"name": "mars", "block_size": 6, "ar_weight": 0.5, "normalization": "token"},
        "mesh": {"rules": dict(sharding.DEFAULT_RULES)},
    }
    wd.write_run_files(workdir, json.dumps(run_config), model.cfg, load_tokenizer(None))
    with Checkpoints(workdir) as checkpoints:
        opt_state = {"count": jnp.zeros((), jnp.int32)}
        checkpoints.save(3, TrainState(nnx.state(model, nnx.Param), opt_state, 0))
    return workdir


def test_export_run_declares_the_mask_token_and_block_size(qwen_vocab, run_dir, tmp_path):
    model, _ = qwen_vocab
    out = tmp_path / "export"
    assert export.export_run(run_dir, str(out)) == 3
    config = json.loads((out / "config.json").read_text())
    assert (config["mask_token_id"], config["mars_block_size"]) == (MASK_ID, 6)
    assert (out / "generation_config.json").exists()
    # transformers: the tokenizer's mask token, special ...
    tok = AutoTokenizer.from_pretrained(str(out))
    assert (tok.mask_token, tok.mask_token_id) == (MASK_TOKEN, MASK_ID)
    assert MASK_ID in tok.all_special_ids and MASK_TOKEN in tok.all_special_tokens
    assert tok.added_tokens_decoder[MASK_ID].special
    assert tok.decode([11, MASK_ID, 12], skip_special_tokens=True) == tok.decode([11, 12])
    # ... the model, with the extra keys as config attributes and the same logits.
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert (hf.config.mask_token_id, hf.config.mars_block_size) == (MASK_ID, 6)
    ids = np.array([[MASK_ID, 151935, 3, ENDOFTEXT_ID, 77]])
    theirs = hf_logits(hf, ids)
    assert theirs.std() > 0.3
    # Our own loaders read the export back (the extra config keys are not refused).
    again = huggingface.load_hf(str(out))
    assert again.cfg == model.cfg
    for a, b in zip(jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(model))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    from tests.model.test_model import our_logits

    np.testing.assert_allclose(our_logits(again, ids), theirs, rtol=0, atol=1e-4)
    assert load_tokenizer(str(out)).mask_id == MASK_ID


def test_exported_files_respect_the_umask(tied_ckpt, tmp_path):
    # safetensors writes its weights with mode 0600; every exported file should have the mode
    # the umask gives any other new file (and the sharded layout too).
    old = os.umask(0o022)
    try:
        model = huggingface.load_hf(str(tied_ckpt[0]))
        huggingface.export_hf(model, str(tmp_path / "one"))
        huggingface.export_hf(model, str(tmp_path / "sharded"), max_shard_bytes=1 << 12)
        os.umask(0o027)
        huggingface.export_hf(model, str(tmp_path / "strict"))
    finally:
        os.umask(old)
    for name, mode in (("one", 0o644), ("sharded", 0o644), ("strict", 0o640)):
        files = sorted((tmp_path / name).iterdir())
        assert any(f.suffix == ".safetensors" for f in files)
        if name == "sharded":
            assert (tmp_path / name / "model.safetensors.index.json").exists()
        assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {
            f.name: mode for f in files
        }


def _front_matter(card):
    """The YAML metadata of a model card and the Markdown after it."""
    _, metadata, body = card.split("---\n", 2)
    return yaml.safe_load(metadata), body


def test_export_run_writes_a_model_card(run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    report = test_eval_plot.report(3, [1.0, 0.95, 0.9], seed=4, workdir=str(run))
    evaluate.write_report(str(run), report)
    out = tmp_path / "export"
    export.export_run(str(run), str(out), base_model="Qwen/Qwen2.5-0.5B-Instruct")
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [IM_END_ID, ENDOFTEXT_ID]
    metadata, card = _front_matter((out / "README.md").read_text())
    assert metadata == {
        "library_name": "transformers",
        "base_model": "Qwen/Qwen2.5-0.5B-Instruct",
        "tags": ["mars", "qwen2"],
    }
    # The run's block size, mask token, objective and init_from.
    assert "| block size (most tokens per forward, as trained) | 6 |" in card
    assert f"| mask token | `{MASK_TOKEN}` (id {MASK_ID}) |" in card
    assert "| objective | mars, ar_weight 0.5, token normalization |" in card
    assert "| initialized from | runs/stage1 |" in card
    assert f"run `{run}`, step 3" in card
    for threshold in ("**1.0**", "**0.95**", "**0.9**"):
        assert threshold in card
    # eval.json's table, one row per threshold.
    assert "## Evaluation (step 3)" in card
    for r in report["results"]:
        row = f"| {r['threshold']:.2f} | {r['accuracy']:.3f} | {r['tokens_per_forward']:.2f} |"
        assert row in card
    assert f"python -m mars_jax.generate --workdir={run} " in card
    # The card's Python example decodes with this export at the run's block size.
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert "block_size=6, threshold=0.95" in code
    code = code.replace('path = "."', f"path = {str(out)!r}")
    code = code.replace("max_new_tokens=256", "max_new_tokens=8")
    exec(code, {})  # compiles the decoder: about 10 s of this test
    tokens_per_forward = float(capsys.readouterr().out.rsplit(" ", 1)[1])
    assert 1.0 <= tokens_per_forward <= 6


def test_model_card_of_an_ar_run_without_evaluation():
    run_config = {
        "init_from": "",
        "objective": {"name": "ar", "block_size": 4, "ar_weight": 1.0, "normalization": "sequence"},
    }
    card = export.model_card(
        run_config, load_tokenizer(None), workdir="runs/ar", step=9, block_size=4
    )
    metadata, body = _front_matter(card)
    assert metadata == {"library_name": "transformers", "tags": ["mars", "qwen2"]}
    assert "| block size (most tokens per forward, as trained) | 4 |" in body
    assert "| initialized from | random initialization |" in body
    assert "trained with the 'ar' objective, not MARS" in body
    assert "## Evaluation" not in body
