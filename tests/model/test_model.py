"""Qwen2 NNX model vs transformers' Qwen2ForCausalLM, HF checkpoint conversion, precision, cache."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from mars_jax import huggingface, kv_cache
from mars_jax.errors import InputError
from mars_jax.kv_cache import SELECT_MAX_SLOTS, init_cache, read_window, write_window
from mars_jax.model import ModelConfig, RMSNorm, causal_mask, rope_tables
from tests.helpers import TINY, hf_logits, save_hf


@nnx.jit
def _logits(model, ids, positions, mask):
    hidden, cache = model(ids, positions, mask)
    assert cache is None
    return model.logits(hidden)


def our_logits(model, ids, valid=None, positions=None):
    """fp32 logits [B, T, V]; ``valid`` [B, T] marks real (non-padding) keys."""
    ids = jnp.asarray(ids, jnp.int32)
    b, t = ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    if valid is None:
        valid = np.ones((b, t), bool)
    mask = causal_mask(t) & jnp.asarray(valid, bool)[:, None, :]
    return np.asarray(_logits(model, ids, jnp.asarray(positions, jnp.int32), mask))


def right_padded_batch(vocab, lengths, t, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (len(lengths), t))
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    ids = np.where(valid, ids, 0)  # pad id 0, like any right padding
    return ids, valid


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def edit_tensors(path, fn):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(params=["tied", "untied"])
def ckpt(request, tied_ckpt, untied_ckpt):
    return tied_ckpt if request.param == "tied" else untied_ckpt


# --------------------------------------------------------------------------------------------
# Logits parity with transformers


def test_config_from_saved_checkpoint(tied_ckpt, untied_ckpt):
    tied = huggingface.load_hf(str(tied_ckpt[0])).cfg
    untied = huggingface.load_hf(str(untied_ckpt[0])).cfg
    assert tied.tie_word_embeddings and not untied.tie_word_embeddings
    assert (tied.num_heads, tied.num_kv_heads, tied.head_dim) == (4, 2, 8)
    assert (untied.head_dim, untied.num_layers) == (12, 3)
    assert tied.rope_theta == 2500.0 and untied.rope_theta == 1e6


def test_logits_match_transformers_right_padded(ckpt):
    path, hf = ckpt
    model = huggingface.load_hf(str(path))
    lengths = [12, 9, 4]
    ids, valid = right_padded_batch(TINY["vocab_size"], lengths, 12, seed=1)
    ours = our_logits(model, ids, valid)
    ref = hf_logits(hf, ids, attention_mask=valid.astype(np.int64))
    assert ours.shape == ref.shape == (3, 12, TINY["vocab_size"])
    assert ref[valid].std() > 0.5  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(ours[valid], ref[valid], rtol=0, atol=1e-4)
    # Padding must not leak into valid positions: row 2 alone gives the same logits.
    alone = our_logits(model, np.tile(ids[2:], (3, 1)), np.tile(valid[2:], (3, 1)))
    np.testing.assert_allclose(ours[2, :4], alone[0, :4], rtol=0, atol=1e-5)


def test_logits_match_transformers_with_position_offsets(ckpt):
    path, hf = ckpt
    model = huggingface.load_hf(str(path))
    lengths = [12, 12, 6]
    ids, valid = right_padded_batch(TINY["vocab_size"], lengths, 12, seed=2)
    # Per-row offsets; row 1 also jumps by 20 half-way, row 2 repeats positions (as MARS does).
    positions = np.arange(12)[None, :] + np.array([0, 17, 101])[:, None]
    positions[1, 5:] += 20
    positions[2, 3:] -= 3
    ours = our_logits(model, ids, valid, positions)
    ref = hf_logits(hf, ids, attention_mask=valid.astype(np.int64), position_ids=positions)
    np.testing.assert_allclose(ours[valid], ref[valid], rtol=0, atol=1e-4)
    # RoPE is relative: a constant offset changes nothing, a jump changes later positions.
    plain = our_logits(model, ids, valid)
    np.testing.assert_allclose(ours[0], plain[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(ours[1, :5], plain[1, :5], rtol=0, atol=1e-4)
    assert np.abs(ours[1, 5:] - plain[1, 5:]).max() > 1e-2
    assert np.abs(ours[2, 3:6] - plain[2, 3:6]).max() > 1e-2


def test_export_roundtrip_through_transformers(ckpt, tmp_path):
    path, hf = ckpt
    model = huggingface.load_hf(str(path))
    ids, valid = right_padded_batch(TINY["vocab_size"], [12, 7, 10], 12, seed=3)
    ref = hf_logits(hf, ids, attention_mask=valid.astype(np.int64))
    for name, shard_bytes in [("single", 4 << 30), ("sharded", 16 << 10)]:
        out = tmp_path / name
        huggingface.export_hf(model, str(out), max_shard_bytes=shard_bytes)
        sharded = (out / "model.safetensors.index.json").exists()
        assert sharded == (name == "sharded")
        if sharded:
            assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
        names = set()
        for f in out.glob("*.safetensors"):
            names |= set(load_file(str(f)))
        assert ("lm_head.weight" in names) == (not model.cfg.tie_word_embeddings)
        reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype="float32").eval()
        assert reloaded.config.tie_word_embeddings == model.cfg.tie_word_embeddings
        got = hf_logits(reloaded, ids, attention_mask=valid.astype(np.int64))
        np.testing.assert_allclose(got[valid], ref[valid], rtol=0, atol=1e-5)
        # ... and our loader reads our own export back to identical parameters.
        again = huggingface.load_hf(str(out))
        for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sharded_hf_checkpoint_loads_identically(tied_ckpt, tmp_path):
    path, _ = tied_ckpt
    sharded = tmp_path / "sharded"
    save_hf(sharded, seed=0, max_shard_size="20KB")  # same weights as tied_ckpt
    assert (sharded / "model.safetensors.index.json").exists()
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a = nnx.state(huggingface.load_hf(str(path)), nnx.Param)
    b = nnx.state(huggingface.load_hf(str(sharded)), nnx.Param)
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (_, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------------------------------------------
# Strict loading


def test_unused_tensor_is_an_error(tied_ckpt, tmp_path):
    path = copy_ckpt(tied_ckpt[0], tmp_path / "extra")
    bogus = "model.layers.1.self_attn.rotary_emb.inv_freq"  # stored by old transformers versions

    def add(t):
        t[bogus] = np.ones((4,), np.float32)

    edit_tensors(path, add)
    with pytest.raises(ValueError, match=r"not used.*rotary_emb\.inv_freq"):
        huggingface.load_hf(str(path))


def with_stored_head(src, dst, head_fn, *, shards=1):
    """A copy of the tied checkpoint ``src`` that also stores ``lm_head.weight`` =
    ``head_fn(embedding)`` (save_pretrained drops tied tensors; some releases keep them).
    ``shards=2`` writes two files plus model.safetensors.index.json, the embedding in the
    first and the head in the second."""
    dst.mkdir()
    shutil.copy(os.path.join(src, "config.json"), dst / "config.json")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors["lm_head.weight"] = np.ascontiguousarray(head_fn(tensors["model.embed_tokens.weight"]))
    if shards == 1:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return dst
    names = sorted(tensors)
    second = {"lm_head.weight", *names[: len(names) // 2]} - {"model.embed_tokens.weight"}
    files = {n: f"model-0000{1 + (n in second)}-of-00002.safetensors" for n in names}
    for fname in sorted(set(files.values())):
        part = {n: tensors[n] for n in names if files[n] == fname}
        save_file(part, str(dst / fname), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": files,
    }
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def load_sharded_on_one_device(path):
    """`huggingface.load_hf_sharded` of ``path`` on a mesh of this process's devices."""
    from mars_jax import sharding
    from mars_jax.model import abstract_params

    cfg = huggingface.read_hf_config(str(path))
    _, abstract = abstract_params(cfg, sharding.make_mesh(), sharding.logical_rules())
    return huggingface.load_hf_sharded(str(path), cfg, abstract)


@pytest.mark.parametrize("shards", [1, 2])
def test_tied_checkpoint_with_an_equal_stored_head_loads(tied_ckpt, tmp_path, caplog, shards):
    path, hf = tied_ckpt
    ckpt = with_stored_head(path, tmp_path / "head", lambda e: e.copy(), shards=shards)
    assert (ckpt / "model.safetensors.index.json").exists() == (shards == 2)
    # transformers loads it (the stored head is the tied embedding) ...
    ids, valid = right_padded_batch(TINY["vocab_size"], [12, 9], 12, seed=4)
    ref = hf_logits(hf, ids, attention_mask=valid.astype(np.int64))
    theirs = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype="float32").eval()
    np.testing.assert_allclose(
        hf_logits(theirs, ids, attention_mask=valid.astype(np.int64))[valid],
        ref[valid],
        rtol=0,
        atol=1e-5,
    )
    # ... and so does every loader of ours, to the parameters of the checkpoint without it.
    caplog.set_level("INFO", logger="absl")
    model = huggingface.load_hf(str(ckpt))
    assert "'lm_head.weight'" in caplog.text and "equals the tied" in caplog.text
    assert model.cfg.tie_word_embeddings
    np.testing.assert_allclose(our_logits(model, ids, valid)[valid], ref[valid], rtol=0, atol=1e-4)
    plain = jax.tree.leaves(nnx.state(huggingface.load_hf(str(path)), nnx.Param))
    state = huggingface.load_hf_state(str(ckpt), model.cfg)
    sharded = load_sharded_on_one_device(ckpt)
    for loaded in (nnx.state(model, nnx.Param), state, sharded):
        leaves = jax.tree.leaves(loaded)
        assert len(leaves) == len(plain)
        for a, b in zip(leaves, plain):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _change_one(embedding, row, delta=0.5):
    head = embedding.copy()
    head[row, 3] += delta
    return head


@pytest.mark.parametrize("shards", [1, 2])
def test_tied_checkpoint_with_a_different_stored_head_is_an_error(tied_ckpt, tmp_path, shards):
    path, _ = tied_ckpt
    ckpt = with_stored_head(path, tmp_path / "head", lambda e: _change_one(e, 90), shards=shards)
    head_file = "model.safetensors" if shards == 1 else "model-00002-of-00002.safetensors"
    emb_file = "model.safetensors" if shards == 1 else "model-00001-of-00002.safetensors"
    cfg = huggingface.read_hf_config(str(ckpt))
    for load in (
        lambda: huggingface.load_hf(str(ckpt)),
        lambda: huggingface.load_hf_state(str(ckpt), cfg),
        lambda: load_sharded_on_one_device(ckpt),
    ):
        with pytest.raises(ValueError) as err:
            load()
        message = str(err.value)
        assert (
            f"'lm_head.weight' ({head_file}) differs from 'model.embed_tokens.weight' "
            f"({emb_file})" in message
        ), message
        assert "row 90" in message and "largest absolute difference 0.5" in message, message


def test_stored_head_is_compared_block_by_block(tied_ckpt, tmp_path, monkeypatch):
    # Blocks of 8 rows (of 32 float64 values): differences are found in any block, and the
    # largest difference is the largest over all blocks.
    monkeypatch.setattr(huggingface, "_COMPARE_CHUNK_BYTES", 8 * 32 * 8)
    path, _ = tied_ckpt
    equal = with_stored_head(path, tmp_path / "equal", lambda e: e.copy())
    huggingface.load_hf(str(equal))
    twice = lambda e: _change_one(_change_one(e, 95, delta=-2.0), 41, delta=0.25)
    differ = with_stored_head(path, tmp_path / "differ", twice)
    with pytest.raises(ValueError, match=r"row 41, largest absolute difference 2\b"):
        huggingface.load_hf(str(differ))


def test_tied_checkpoint_with_a_wrongly_shaped_stored_head_is_an_error(tied_ckpt, tmp_path):
    path, _ = tied_ckpt
    ckpt = with_stored_head(path, tmp_path / "head", lambda e: e[:, :16])
    with pytest.raises(
        ValueError,
        match=r"'lm_head\.weight' has shape \(96, 16\), but the "
        r"config ties it to 'model\.embed_tokens\.weight'",
    ):
        huggingface.load_hf(str(ckpt))


def test_untied_config_without_lm_head_is_an_error(tied_ckpt, tmp_path):
    # A tied checkpoint whose config.json claims separate embeddings: lm_head.weight is missing.
    path = copy_ckpt(tied_ckpt[0], tmp_path / "untied_cfg")
    edit_config(path, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"missing tensor 'lm_head\.weight'"):
        huggingface.load_hf(str(path))


def test_dropped_bias_is_an_error(tied_ckpt, tmp_path):
    path = copy_ckpt(tied_ckpt[0], tmp_path / "no_bias")
    edit_tensors(path, lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"))
    with pytest.raises(
        ValueError, match=r"missing tensor 'model\.layers\.0\.self_attn\.k_proj\.bias'"
    ):
        huggingface.load_hf(str(path))


def test_shape_mismatch_is_an_error(tied_ckpt, tmp_path):
    path = copy_ckpt(tied_ckpt[0], tmp_path / "shape")
    edit_config(path, intermediate_size=48)  # the checkpoint's MLP is 64 wide
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.(down|gate|up)_proj\.weight' has shape"
    ):
        huggingface.load_hf(str(path))


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        # Qwen2.5's documented long-context recipe (old-style top-level rope_scaling).
        (
            {
                "rope_parameters": None,
                "rope_theta": 1e6,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                },
            },
            "yarn",
        ),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "linear"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "gemma2"}, "model_type"),
    ],
)
def test_unsupported_configs_are_errors(tied_ckpt, tmp_path, changes, field):
    path = copy_ckpt(tied_ckpt[0], tmp_path / "cfg")
    edit_config(path, **changes)
    with pytest.raises(ValueError, match=field):
        huggingface.load_hf(str(path))


def test_old_style_rope_theta_is_read():
    hf = {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
    }
    cfg = huggingface.config_from_hf(hf)
    assert (cfg.rope_theta, cfg.head_dim, cfg.num_kv_heads) == (1e6, 64, 2)
    assert cfg.vocab_size == 151936


def test_embedding_rows_come_from_config_vocab_size(tmp_path):
    # Qwen2.5's 151,936 embedding rows (> the tokenizer's 151,666 ids), on a very narrow model.
    small = dict(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    hf = save_hf(tmp_path / "big_vocab", seed=5, vocab_size=151936, **small)
    model = huggingface.load_hf(str(tmp_path / "big_vocab"))
    assert model.cfg.vocab_size == 151936
    assert model.embed_tokens.embedding.shape == (151936, 8)
    ids = np.array([[151935, 151665, 3, 151643]])
    np.testing.assert_allclose(our_logits(model, ids), hf_logits(hf, ids), rtol=0, atol=1e-4)
    huggingface.export_hf(model, str(tmp_path / "export"))
    with open(tmp_path / "export" / "config.json") as f:
        assert json.load(f)["vocab_size"] == 151936
    assert load_file(str(tmp_path / "export" / "model.safetensors"))[
        "model.embed_tokens.weight"
    ].shape == (151936, 8)


def test_missing_rope_theta_takes_transformers_default(tied_ckpt, tmp_path):
    """A config.json without rope_theta: transformers' Qwen2 default (10000), not Qwen2.5's 1e6
    (which differed from transformers' logits by 2e-3 here)."""
    path = copy_ckpt(tied_ckpt[0], tmp_path / "no_theta")
    hf_cfg = json.loads((path / "config.json").read_text())
    for key in ("rope_theta", "rope_parameters", "rope_scaling"):
        hf_cfg.pop(key, None)
    (path / "config.json").write_text(json.dumps(hf_cfg))
    model = huggingface.load_hf(str(path))
    assert model.cfg.rope_theta == 10000.0
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype="float32").eval()
    ids, valid = right_padded_batch(TINY["vocab_size"], [12, 9], 12, seed=4)
    ref = hf_logits(theirs, ids, attention_mask=valid.astype(np.int64))
    np.testing.assert_allclose(our_logits(model, ids, valid)[valid], ref[valid], rtol=0, atol=1e-4)


def test_load_then_export_keeps_every_field(tmp_path):
    """transformers reads our export of a loaded checkpoint back to the source's values."""
    fields = dict(
        max_position_embeddings=4096,
        rope_theta=2500.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        num_key_value_heads=1,
        head_dim=12,
    )
    save_hf(tmp_path / "src", seed=3, **fields)
    huggingface.export_hf(huggingface.load_hf(str(tmp_path / "src")), str(tmp_path / "out"))
    source = AutoConfig.from_pretrained(str(tmp_path / "src"))
    back = AutoConfig.from_pretrained(str(tmp_path / "out"))
    for key in [*fields, "vocab_size", "hidden_size", "num_attention_heads"]:
        if key == "rope_theta":
            assert back.rope_parameters["rope_theta"] == source.rope_parameters["rope_theta"]
        else:
            assert getattr(back, key) == getattr(source, key), key


def test_a_tensor_is_read_from_the_shard_the_index_names(tied_ckpt, tmp_path, caplog):
    path = tmp_path / "stale"
    save_hf(path, seed=0, max_shard_size="20KB")  # tied_ckpt's weights, in several files
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    other = max(index.values())  # the stale copy goes into the file read last
    name = next(n for n, f in sorted(index.items()) if f != other and n.endswith("q_proj.weight"))
    tensors = load_file(str(path / other))
    tensors[name] = np.zeros_like(load_file(str(path / index[name]))[name])  # a stale copy
    save_file(tensors, str(path / other), metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        loaded = huggingface.load_hf(str(path))
    assert f"a copy of {name!r}" in caplog.text and other in caplog.text
    expected = huggingface.load_hf(str(tied_ckpt[0]))
    for a, b in zip(jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(expected))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A tensor that the index does not list, and an index entry whose file lacks it: errors.
    tensors["model.extra.weight"] = np.ones((2,), np.float32)
    save_file(tensors, str(path / other), metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"'model.extra.weight' is not in .*weight_map"):
        huggingface.load_hf(str(path))
    del tensors["model.extra.weight"], tensors[name]
    save_file(tensors, str(path / other), metadata={"format": "pt"})
    moved = {**index, name: other}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(InputError, match=f"reads tensor {name!r} from {other}, which does not"):
        huggingface.load_hf(str(path))


def test_model_safetensors_beside_an_index_wins_as_in_transformers(tied_ckpt, tmp_path, caplog):
    path = tmp_path / "both"
    save_hf(path, seed=7, max_shard_size="20KB")  # an older sharded save
    shutil.copy(tied_ckpt[0] / "model.safetensors", path / "model.safetensors")
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype="float32").eval()
    ids, valid = right_padded_batch(TINY["vocab_size"], [12, 5], 12, seed=5)
    ref = hf_logits(theirs, ids, attention_mask=valid.astype(np.int64))
    np.testing.assert_allclose(ref[valid], hf_logits(tied_ckpt[1], ids)[valid], atol=1e-5)
    with caplog.at_level("WARNING"):
        ours = our_logits(huggingface.load_hf(str(path)), ids, valid)
    np.testing.assert_allclose(ours[valid], ref[valid], rtol=0, atol=1e-4)
    assert caplog.text.count("the index and its shards are ignored") == 1  # once per load


# --------------------------------------------------------------------------------------------
# Mixed precision


def test_bf16_compute_close_to_fp32(untied_ckpt):
    path, _ = untied_ckpt
    fp32 = huggingface.load_hf(str(path))
    bf16 = huggingface.load_hf(str(path), dtype="bfloat16", param_dtype="float32")
    assert bf16.layers.self_attn.q_proj.kernel[...].dtype == jnp.float32
    ids, valid = right_padded_batch(TINY["vocab_size"], [12, 12, 12], 12, seed=4)
    positions = jnp.broadcast_to(jnp.arange(12), (3, 12))
    hidden = nnx.eval_shape(
        lambda m: m(jnp.asarray(ids, jnp.int32), positions, causal_mask(12))[0], bf16
    )
    assert hidden.dtype == jnp.bfloat16
    lo = our_logits(bf16, ids)
    assert lo.dtype == np.float32
    hi = our_logits(fp32, ids)
    scale = np.abs(hi).max()
    assert scale > 1.0
    err = np.abs(lo - hi).max()
    assert err < 0.05 * scale, (err, scale)
    assert err > 0  # it really ran in bf16
    # Same predictions almost everywhere.
    assert (lo.argmax(-1) == hi.argmax(-1)).mean() >= 0.9


def test_rope_tables_are_fp32_and_exact():
    positions = jnp.array([[0, 1, 7, 300, 999]], jnp.int32)
    cos, sin = rope_tables(positions, 16, 1e4)
    assert cos.dtype == sin.dtype == jnp.float32 and cos.shape == (1, 5, 16)
    inv = 1.0 / 1e4 ** (np.arange(0, 16, 2) / 16)
    ang = np.asarray(positions, np.float64)[..., None] * inv
    ang = np.concatenate([ang, ang], -1)
    np.testing.assert_allclose(np.asarray(cos), np.cos(ang), atol=2e-4)
    np.testing.assert_allclose(np.asarray(sin), np.sin(ang), atol=2e-4)


def test_rmsnorm_of_bf16_input_is_computed_in_fp32():
    cfg = ModelConfig(
        vocab_size=8,
        hidden_size=512,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        rms_norm_eps=1e-6,
        dtype="bfloat16",
        param_dtype="float32",
    )
    norm = RMSNorm(512, 1e-6, cfg)
    rng = np.random.default_rng(0)
    w = (1 + 0.5 * rng.standard_normal(512)).astype(np.float32)
    norm.weight[...] = jnp.asarray(w)
    # Large magnitudes and a wide dynamic range (a few huge outliers among moderate values).
    x = rng.standard_normal((4, 512)) * 300.0
    x[:, :3] *= 200.0
    x = jnp.asarray(x, jnp.bfloat16)
    y = norm(x)
    assert y.dtype == jnp.bfloat16
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * w
    # Only the final rounding to bf16 is allowed: relative error <= 2^-8 (half an ulp + slack).
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), ref, rtol=2.0**-8, atol=1e-6)


# --------------------------------------------------------------------------------------------
# KV cache


def test_chunked_cached_forward_equals_full_forward(untied_ckpt):
    model = huggingface.load_hf(str(untied_ckpt[0]))
    b, t, slots, split = 2, 11, 16, 5
    ids = jnp.asarray(np.random.default_rng(7).integers(0, TINY["vocab_size"], (b, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    run = nnx.jit(lambda m, *args: m(*args))
    full, _ = run(model, ids, pos, causal_mask(t))

    cache = init_cache(model.cfg, b, slots)
    layers = model.cfg.num_layers
    assert cache["k"].shape == (layers, b, slots, model.cfg.num_kv_heads, model.cfg.head_dim)
    outs = []
    for start, stop in [(0, split), (split, t)]:
        h, cache = run(
            model,
            ids[:, start:stop],
            pos[:, start:stop],
            None,
            cache,
            jnp.full((b,), start, jnp.int32),
        )
        outs.append(h)
    np.testing.assert_allclose(
        np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), rtol=0, atol=1e-5
    )
    # Slots past the written prefix are untouched.
    assert float(jnp.abs(cache["k"][:, :, t:]).max()) == 0.0
    assert all(float(jnp.abs(cache["k"][i, :, t - 1]).max()) > 0 for i in range(layers))


# Per-row windows: write_window / read_window as called (on CPU: the vmapped dynamic slices), and
# their TPU implementation (elementwise selects) run here on CPU.
ROW_WRITES = {"write_window": write_window, "select": kv_cache._write_select}
ROW_READS = {"read_window": read_window, "select": kv_cache._read_select}


@pytest.mark.parametrize("impl", ROW_WRITES)
@pytest.mark.parametrize("t", [1, 7, SELECT_MAX_SLOTS, SELECT_MAX_SLOTS + 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_write_window_writes_each_row_at_its_own_positions(impl, t, dtype):
    # Windows at either end of the array, trailing [K, H] dims; exact values, the rest untouched.
    r, n = 5, 40
    rng = np.random.default_rng(t)
    x = (rng.standard_normal((r, n, 2, 3)) * 100).astype(dtype)
    new = (rng.standard_normal((r, t, 2, 3)) * 100).astype(dtype)
    start = np.array([0, n - t, 3, 11, 3], np.int32)
    ref = x.copy()
    for i in range(r):
        ref[i, start[i] : start[i] + t] = new[i]
    out = jax.jit(ROW_WRITES[impl])(
        jnp.asarray(x, dtype), jnp.asarray(new, dtype), jnp.asarray(start)
    )
    assert out.dtype == jnp.dtype(dtype) and out.shape == x.shape
    ref = jnp.asarray(ref, dtype)  # bf16: the same rounding of the same inputs
    np.testing.assert_array_equal(
        np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    )


@pytest.mark.parametrize("impl", ROW_READS)
@pytest.mark.parametrize("size", [1, 7, SELECT_MAX_SLOTS, SELECT_MAX_SLOTS + 3])
@pytest.mark.parametrize("shape", [(5, 40), (5, 40, 3)])
def test_read_window_reads_each_row_at_its_own_positions(impl, size, shape):
    r, n = shape[:2]
    rng = np.random.default_rng(size)
    x = rng.integers(-1000, 1000, shape).astype(np.int32)
    start = np.array([0, n - size, 3, 11, 3], np.int32)
    ref = np.stack([x[i, start[i] : start[i] + size] for i in range(r)])
    for dtype in ("int32", "float32"):
        out = jax.jit(ROW_READS[impl], static_argnums=2)(
            jnp.asarray(x, dtype), jnp.asarray(start), size
        )
        assert out.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(out), ref.astype(dtype))
