"""``add_mask_token``: ``<|mask|>`` added as a new embedding row when the vocabulary fills the
embedding (SmolLM2, Llama 3), as the paper adds one token.

A tiny untied Llama with SmolLM2's tokenizer layout (ChatML at ids 0-2, 49,152 ids filling the
embedding) trains MARS from its Hugging Face directory at learning rate 0. Oracles: the
directory's own weights (old rows unchanged, new rows the mean as transformers'
``resize_token_embeddings`` initialises them), transformers' greedy ``generate`` of the
original model (our threshold-1.0 decoding of the run, and transformers' decoding of its
export), transformers' reading of the exported tokenizer and config."""

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_jax import export, train
from mars_jax import workdir as wd
from mars_jax.errors import InputError
from mars_jax.model import grown_vocab_size
from mars_jax.tokenizer import load_tokenizer
from tests.helpers import complete, tiny_config, write_smol_layout

PROMPT = "What is 2 + 3?"


@pytest.fixture(scope="module")
def smol_layout(smollm2_dir, tmp_path_factory):
    """(directory, transformers model): a tiny random untied Llama with SmolLM2's tokenizer."""
    return write_smol_layout(tmp_path_factory.mktemp("smol_layout"), smollm2_dir)


def greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=2,
            pad_token_id=2,
        )[0, len(ids) :].tolist()
    return out[: out.index(2)] if 2 in out else out


def config(path, **overrides):
    return tiny_config(
        "mars",
        init_from=str(path),
        train__learning_rate=0.0,
        train__num_steps=1,
        train__batch_size=2,
        data__max_length=128,
        data__num_synthetic_train=4,
        **overrides,
    )


@pytest.mark.real_model
def test_without_the_setting_the_missing_row_is_refused_naming_it(smol_layout, tmp_path):
    with pytest.raises(InputError, match=r"<\|mask\|> id 49152 has no row .*add_mask_token"):
        train.train(config(smol_layout[0]), str(tmp_path / "run"))


@pytest.mark.real_model
def test_an_added_mask_row_trains_decodes_and_exports(smol_layout, tmp_path):
    path, hf = smol_layout
    run = str(tmp_path / "run")
    last = train.train(config(path, add_mask_token=True), run)
    assert np.isfinite(last["loss"]) and last["noisy_loss"] > 0  # the masks were read
    model, tok, _ = wd.load_model(run)
    assert model.cfg.vocab_size == grown_vocab_size(49152, 49153) == 49280
    assert (tok.mask_id, tok.mask_declared, len(tok)) == (49152, True, 49153)
    # Old rows are the directory's; the new rows and head columns its mean rows.
    embed = np.asarray(nnx.state(model)["embed_tokens"]["embedding"][...])
    head = np.asarray(nnx.state(model)["lm_head"]["kernel"][...])
    theirs = hf.get_input_embeddings().weight.detach().numpy()
    np.testing.assert_array_equal(embed[:49152], theirs)
    np.testing.assert_allclose(embed[49152:], np.broadcast_to(theirs.mean(0), (128, 32)), atol=1e-4)
    out_head = hf.get_output_embeddings().weight.detach().numpy()
    np.testing.assert_array_equal(head[:, :49152], out_head.T)
    np.testing.assert_allclose(
        head[:, 49152:].T, np.broadcast_to(out_head.mean(0), (128, 32)), atol=1e-4
    )
    # Threshold 1.0 at block size 4 decodes the original model's greedy tokens.
    ids = load_tokenizer(str(path)).apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    expected = greedy(hf, ids, 12)
    assert len(expected) >= 3
    out = complete(run, [PROMPT], threshold=1.0, max_new_tokens=12)
    assert out[0]["tokens"] == expected
    # The export: transformers reads the new vocabulary size and the mask, and decodes the same.
    export.export_run(run, str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert exported.config.vocab_size == 49280 and exported.config.mask_token_id == 49152
    assert (hf_tok.mask_token, hf_tok.mask_token_id, len(hf_tok)) == ("<|mask|>", 49152, 49153)
    assert greedy(exported.eval(), ids, 12) == expected
