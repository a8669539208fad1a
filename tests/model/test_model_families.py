"""The Qwen3 and Llama 3 families (`ModelConfig.family`) against transformers' own classes, on
tiny random checkpoints (tests/model/conftest.py's ``family_ckpt``): logits, greedy decoding, export both ways,
strict loading, and a Qwen3 directory with Qwen3's tokenizer layout trained AR then MARS. Their
MARS and AR objectives are checked by meaning in test_objectives.py."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from mars_jax import huggingface, train
from mars_jax import workdir as wd
from mars_jax.errors import InputError
from mars_jax.model import ModelConfig, inverse_frequencies
from mars_jax.tokenizer import MASK_ID, load_tokenizer
from tests.decode_oracles import qwen_generate
from tests.helpers import FAMILY_CONFIGS, TINY, complete, hf_logits
from tests.model.test_model import our_logits, right_padded_batch
from tests.train_runs import get_config

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
        ours = qwen_generate(
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
    out = complete(mars, ["What is 2 + 3?"], threshold=0.5, max_new_tokens=6)
    assert 1 <= len(out[0]["tokens"]) <= 6


LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def write_llama3_directory(path, *, mask_token: bool = True):
    """A tiny Llama 3 laid out as a release is: a byte-level BPE (the 256 bytes, then Llama 3's
    special tokens at 256-261, its vocabulary filling the 262-row embedding), the eos_token
    <|eot_id|>, stop ids in generation_config.json, a Llama 3 style chat template; with
    ``mask_token``, tokenizer_config.json names a reserved token as the mask."""
    import tokenizers

    from mars_jax.tokenizer import _bpe_model, _byte_to_unicode

    backend = _bpe_model({c: b for b, c in _byte_to_unicode().items()}, [])
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS]
    )
    path.mkdir(parents=True)
    backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    config["chat_template"] = LLAMA3_TEMPLATE
    if mask_token:
        config["mask_token"] = "<|reserved_special_token_0|>"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(1)
    llama_cls, fields = FAMILY_CONFIGS["llama"]
    hf = AutoModelForCausalLM.from_config(
        llama_cls(**{**TINY, **fields, "vocab_size": 262, "num_hidden_layers": 1})
    )
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape) * 0.15)
    hf.eval().save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 261]}))
    return hf


def test_llama3_from_text_reads_its_own_control_tokens(tmp_path):
    write_llama3_directory(tmp_path / "llama")
    tok = load_tokenizer(str(tmp_path / "llama"))
    assert (tok.bos_id, tok.eos_id, tok.eos_ids, tok.pad_id) == (
        256,
        261,
        (261, 257),
        261,
    )
    assert (tok.mask_id, tok.mask_declared) == (258, True)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "llama")).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == list(theirs)
    assert "<|eot_id|>" in tok.control_strings and "<|im_end|>" not in tok.control_strings
    # Saved (as a run saves it) and read back: the same ids.
    tok.save(str(tmp_path / "saved"))
    again = load_tokenizer(str(tmp_path / "saved"))
    assert (again.eos_ids, again.mask_id, again.bos_id) == ((261, 257), 258, 256)


def test_llama3_trains_ar_then_mars_from_text_and_decodes(tmp_path):
    """Stage 1 at learning rate 0 decodes transformers' greedy tokens, stopping at <|eot_id|>;
    stage 2 trains MARS with the reserved mask token; without a mask_token, <|mask|> would need
    row 262 of a 262-row embedding, and training stops naming the fix."""
    hf = write_llama3_directory(tmp_path / "llama")
    data = dict(data__max_length=512, train__batch_size=2, data__num_synthetic_train=8)
    ar = str(tmp_path / "ar")
    cfg = get_config("ar", init_from=str(tmp_path / "llama"), train__learning_rate=0.0, **data)
    train.train(cfg, ar)
    out = complete(ar, ["What is 2 + 3?"], threshold=1.0, max_new_tokens=12)
    tok = load_tokenizer(str(tmp_path / "llama"))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True
    )
    theirs = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=[261, 257],
        pad_token_id=261,
    )[0, len(ids) :].tolist()
    stops = [i for i, t in enumerate(theirs) if t in (261, 257)]
    assert out[0]["tokens"] == (theirs[: stops[0]] if stops else theirs)
    assert len(out[0]["tokens"]) >= 3  # a real completion, not an immediate stop
    mars = str(tmp_path / "mars")
    last = train.train(get_config("mars", init_from=ar, train__num_steps=2, **data), mars)
    assert np.isfinite(last["loss"]) and last["noisy_loss"] > 0
    assert wd.load_model(mars)[1].mask_id == 258
    out = complete(mars, ["What is 2 + 3?"], threshold=0.5, max_new_tokens=8)
    assert 0 <= len(out[0]["tokens"]) <= 8

    write_llama3_directory(tmp_path / "no_mask", mask_token=False)
    with pytest.raises(InputError, match=r"<\|mask\|> id 262 has no row .* mask_token"):
        train.train(
            get_config("ar", init_from=str(tmp_path / "no_mask"), **data), str(tmp_path / "x")
        )
