"""The Qwen3 and Llama 3 families (`ModelConfig.family`) against transformers' own classes, on
tiny random checkpoints (conftest's ``family_ckpt``): logits, greedy decoding, export both ways,
strict loading, and a Qwen3 directory with Qwen3's tokenizer layout trained AR then MARS. Their
MARS and AR objectives are checked by meaning in test_objectives.py."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

from mars_jax import decode, generate, huggingface, train
from mars_jax import workdir as wd
from mars_jax.errors import InputError
from mars_jax.model import ModelConfig, inverse_frequencies
from mars_jax.tokenizer import MASK_ID, load_tokenizer

from conftest import TINY, hf_logits
from test_model import our_logits, right_padded_batch
from train_runs import get_config

V = TINY["vocab_size"]


def test_config_reads_the_family(family_ckpt):
    family, path, _ = family_ckpt
    cfg = huggingface.load_hf(str(path)).cfg
    assert (cfg.family, cfg.attention_bias, cfg.qk_norm) == (family, False, family == "qwen3")
    if family == "llama":
        assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_position_embeddings) == (
            "llama3",
            4.0,
            32,
        )
        assert not cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-5
    else:
        assert cfg.head_dim == 12 and cfg.hidden_size // cfg.num_heads == 8


def test_logits_match_transformers(family_ckpt):
    _, path, hf = family_ckpt
    model = huggingface.load_hf(str(path))
    ids, valid = right_padded_batch(V, [12, 9, 5], 12, seed=6)
    # Positions far past the llama3 rope's original context (32), where its scaling acts.
    positions = np.arange(12)[None, :] + np.array([0, 40, 300])[:, None]
    ours = our_logits(model, ids, valid, positions)
    ref = hf_logits(hf, ids, attention_mask=valid.astype(np.int64), position_ids=positions)
    assert ref[valid].std() > 0.5
    np.testing.assert_allclose(ours[valid], ref[valid], rtol=0, atol=1e-4)


def test_llama3_rope_scales_only_the_low_frequencies():
    plain = ModelConfig(head_dim=16, rope_theta=500.0)
    scaled = ModelConfig(
        head_dim=16,
        rope_theta=500.0,
        rope_type="llama3",
        rope_factor=4.0,
        rope_original_max_position_embeddings=32,
    )
    a, b = np.asarray(inverse_frequencies(plain)), np.asarray(inverse_frequencies(scaled))
    wavelen = 2 * np.pi / a
    np.testing.assert_array_equal(b[wavelen < 32 / 4], a[wavelen < 32 / 4])  # high: kept
    np.testing.assert_allclose(b[wavelen > 32], a[wavelen > 32] / 4, rtol=1e-6)  # low: / factor
    assert (wavelen > 32).any() and (wavelen < 8).any()


def test_greedy_decoding_equals_transformers(family_ckpt):
    """Threshold 1.0 at block size 4 is AR decoding: transformers' greedy tokens, EOS included."""
    _, path, hf = family_ckpt
    model = huggingface.load_hf(str(path))
    eos, pad, mask = V - 2, V - 3, V - 1
    prompts = [[5, 17, 33, 2, 9], [44, 3, 61]]
    for prompt in prompts:
        ids = np.asarray([prompt], np.int32)
        ours = decode.generate(
            model,
            ids,
            np.asarray([len(prompt)], np.int32),
            block_size=4,
            threshold=1.0,
            max_new_tokens=12,
            eos_ids=(eos,),
            mask_id=mask,
        )
        theirs = hf.generate(
            torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.ones(ids.shape, dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=eos,
            pad_token_id=pad,
        )[0, len(prompt) :].tolist()
        theirs = theirs[: theirs.index(eos) + 1] if eos in theirs else theirs
        assert ours.completions()[0] == theirs


def test_export_both_ways(family_ckpt, tmp_path):
    """Our export reads back into transformers' class of the family with the same logits and
    config fields, and into ours with the same parameters."""
    family, path, hf = family_ckpt
    model = huggingface.load_hf(str(path))
    huggingface.export_hf(model, str(tmp_path / "out"))
    source, back = (
        AutoConfig.from_pretrained(str(path)),
        AutoConfig.from_pretrained(tmp_path / "out"),
    )
    assert back.model_type == source.model_type == family
    for key in ("head_dim", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(back, key) == getattr(source, key), key
    assert back.tie_word_embeddings == source.tie_word_embeddings
    assert back.rope_parameters == source.rope_parameters
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype="float32").eval()
    assert type(reloaded) is type(hf)
    ids, valid = right_padded_batch(V, [12, 7], 12, seed=8)
    positions = np.arange(12)[None, :] + np.array([0, 100])[:, None]
    kw = dict(attention_mask=valid.astype(np.int64), position_ids=positions)
    np.testing.assert_allclose(
        hf_logits(reloaded, ids, **kw)[valid], hf_logits(hf, ids, **kw)[valid], rtol=0, atol=1e-5
    )
    again = huggingface.load_hf(str(tmp_path / "out"))
    assert again.cfg == model.cfg
    np.testing.assert_array_equal(
        np.asarray(again.layers.self_attn.q_proj.kernel[...]),
        np.asarray(model.layers.self_attn.q_proj.kernel[...]),
    )


def test_strict_loading_names_the_tensor(family_ckpt, tmp_path):
    family, path, _ = family_ckpt
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    if family == "qwen3":  # a Qwen3 without its query norm
        del tensors["model.layers.1.self_attn.q_norm.weight"]
        match = r"missing tensor 'model\.layers\.1\.self_attn\.q_norm\.weight'"
    else:  # a Llama with a q bias it does not have
        tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros((32,), np.float32)
        match = r"not used by the model.*q_proj\.bias"
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match=match):
        huggingface.load_hf(str(broken))
    config = json.loads((path / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "mlp_bias": True}))
    with pytest.raises(InputError, match="mlp_bias"):
        huggingface.load_hf(str(broken))


def test_bfloat16_compute_keeps_the_family(family_ckpt):
    _, path, _ = family_ckpt
    fp32 = huggingface.load_hf(str(path))
    bf16 = huggingface.load_hf(str(path), dtype="bfloat16")
    ids = np.asarray([[5, 17, 33, 2, 9, 40]])
    a, b = our_logits(fp32, ids), our_logits(bf16, ids)
    assert b.dtype == np.float32 and jnp.dtype(bf16.cfg.dtype) == jnp.bfloat16
    assert np.abs(a - b).max() < 0.1 * np.abs(a).max()


def write_qwen3_directory(path):
    """A tiny random Qwen3 with the real vocabulary's rows, saved with tokenizer files laid out
    as Qwen3's: <tool_response>, </tool_response>, <think>, </think> at 151665-151668 and no
    <|mask|> (a base checkpoint before MARS training)."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=151680,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        rope_theta=5000.0,
        tie_word_embeddings=True,
    )
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    hf.eval().save_pretrained(str(path))
    load_tokenizer(None).save(str(path))
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < MASK_ID]
    config = json.loads((path / "tokenizer_config.json").read_text())
    decoder = {k: v for k, v in config["added_tokens_decoder"].items() if int(k) < MASK_ID}
    for i, text in enumerate(["<tool_response>", "</tool_response>", "<think>", "</think>"]):
        decoder[str(MASK_ID + i)] = {"content": text, "special": False}
    config.update(added_tokens_decoder=decoder)
    config.pop("mask_token")
    (path / "tokenizer.json").write_text(json.dumps(spec))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return hf


def test_qwen3_trains_ar_then_mars_and_decodes(tmp_path):
    """Stage 1 at learning rate 0 keeps transformers' Qwen3 exactly; stage 2 trains MARS with
    <|mask|> placed past Qwen3's tokens (151669), and the run decodes with it."""
    hf = write_qwen3_directory(tmp_path / "qwen3")
    ar = str(tmp_path / "ar")
    cfg = get_config(
        "ar", init_from=str(tmp_path / "qwen3"), train__num_steps=1, train__learning_rate=0.0
    )
    train.train(cfg, ar)
    model, tok, _ = wd.load_model(ar)
    assert (model.cfg.family, model.cfg.qk_norm, tok.mask_id) == ("qwen3", True, 151669)
    ids = np.random.default_rng(0).integers(0, 151680, size=(2, 12))
    np.testing.assert_allclose(our_logits(model, ids), hf_logits(hf, ids), rtol=0, atol=1e-4)
    mars = str(tmp_path / "mars")
    last = train.train(get_config("mars", init_from=ar, train__num_steps=2), mars)
    assert np.isfinite(last["loss"]) and last["noisy_loss"] > 0
    out = generate.complete(mars, ["What is 2 + 3?"], threshold=0.5, max_new_tokens=6)
    assert 1 <= len(out[0]["tokens"]) <= 6
