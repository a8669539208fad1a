"""Decoding straight from a Hugging Face directory (`mars_jax.sources`), on a tiny checkpoint
written in exactly the format of the paper's released MARS checkpoints: transformers'
save_pretrained of a Qwen2, config.json renamed to ``model_type: "a2d-qwen2"`` /
``A2DQwen2LMHeadModel`` with an ``auto_map``, and tokenizer files with ``<|mask|>`` added as a
special token. Oracles: transformers' greedy ``generate`` (threshold 1.0 is AR decoding, at any
block size), and `decode.generate` of the same weights loaded on their own."""

import hashlib
import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch

from mars_jax import engine, evaluate, huggingface, serve, sources
from mars_jax.errors import InputError
from mars_jax.tokenizer import DEFAULT_EOS_IDS, ENDOFTEXT_ID, MASK_ID, load_tokenizer
from tests.decode_oracles import qwen_generate
from tests.helpers import complete, tiny_config, write_released

PROMPT = "What is 2 + 3?"
MAX_NEW = 10


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    path = tmp_path_factory.mktemp("released") / "mars-qwen2.5-b4"
    return write_released(path), str(path)


def prompt_ids():
    return load_tokenizer(None).apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )


def transformers_greedy(model, ids, max_new_tokens):
    """transformers' greedy completion of ``ids``, cut before its first EOS."""
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(DEFAULT_EOS_IDS),
        pad_token_id=ENDOFTEXT_ID,
    )[0, len(ids) :].tolist()
    ends = [i for i, t in enumerate(out) if t in DEFAULT_EOS_IDS]
    return out[: ends[0]] if ends else out


def test_released_format_decodes_as_transformers(released, caplog):
    hf, path = released
    with caplog.at_level(logging.WARNING):
        out = complete(path, [PROMPT], threshold=1.0, block_size=4, max_new_tokens=MAX_NEW)
    assert out[0]["tokens"] == transformers_greedy(hf, prompt_ids(), MAX_NEW)
    assert out[0]["tokens_per_forward"] == 1.0
    assert "auto_map" in caplog.text  # named, not run


def test_mars_decoding_reads_the_mask_from_the_tokenizer_files(released):
    _, path = released
    model, tok, step = sources.load_model(path)
    assert (step, tok.mask_id, tok.mask_declared) == (0, MASK_ID, True)
    assert model.cfg.max_position_embeddings == 4096 and not model.cfg.tie_word_embeddings
    got = complete(path, [PROMPT], threshold=0.3, block_size=4, max_new_tokens=MAX_NEW)
    ids = np.asarray([prompt_ids()], np.int32)
    want = qwen_generate(
        huggingface.load_hf(path),
        ids,
        np.asarray([ids.shape[1]], np.int32),
        block_size=4,
        threshold=0.3,
        max_new_tokens=MAX_NEW,
        mask_id=MASK_ID,
    )
    assert got[0]["tokens"] == [t for t in want.completions()[0] if t not in DEFAULT_EOS_IDS]
    assert got[0]["tokens_per_forward"] == pytest.approx(want.tokens_per_forward)


def test_block_size_comes_from_config_or_is_asked_for(released, tmp_path):
    _, path = released
    with pytest.raises(
        InputError, match="records no mars_block_size, and its tokenizer has <.mask.>"
    ):
        complete(path, [PROMPT], max_new_tokens=2)
    recorded = tmp_path / "b8"
    write_released(recorded, block_size=8)
    assert sources.block_size_of(str(recorded)) == 8
    assert sources.block_size_of(str(recorded), 4) == 4
    assert sources.open(str(recorded)).block_size == 8


def test_open_gives_the_ids_of_the_directory_s_own_files(released, tmp_path):
    """`sources.open`'s ids are those transformers reads from the same files; the block size is
    resolved before any weight is read; a model without <|mask|> is refused above block size 1."""
    from transformers import AutoTokenizer, GenerationConfig

    _, path = released
    opened = sources.open(path, block_size=4)
    hf_tok = AutoTokenizer.from_pretrained(path)
    stops = {hf_tok.eos_token_id}
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        stops |= set(eos if isinstance(eos, list) else [eos])
    except OSError:  # no generation_config.json
        pass
    assert (opened.step, opened.block_size) == (0, 4)
    assert opened.mask_id == hf_tok.convert_tokens_to_ids("<|mask|>") == MASK_ID
    assert opened.pad_id == hf_tok.pad_token_id
    assert set(opened.stop_ids) == stops
    assert opened.decode_ids() == {
        "eos_ids": opened.stop_ids,
        "mask_id": opened.mask_id,
        "pad_id": opened.pad_id,
    }
    no_weights = tmp_path / "no_weights"
    shutil.copytree(path, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(
        InputError, match="records no mars_block_size, and its tokenizer has <.mask.>"
    ):
        sources.open(str(no_weights))
    plain = tmp_path / "plain"
    write_released(plain, mask=False)
    assert sources.open(str(plain), block_size=1).mask_id is None
    # A plain model (never trained with MARS) decodes one token per forward without a flag.
    assert sources.open(str(plain)).block_size == 1
    with pytest.raises(InputError, match=r"declare no <\|mask\|> token"):
        sources.open(str(plain), block_size=4)


def test_without_a_mask_token_only_one_token_per_forward(released, tmp_path):
    hf, _ = released
    plain = tmp_path / "plain"
    write_released(plain, mask=False)
    _, tok, _ = sources.load_model(str(plain))
    assert tok.mask_id is None
    with pytest.raises(InputError, match=r"declare no <\|mask\|> token"):
        complete(str(plain), [PROMPT], block_size=4, max_new_tokens=2)
    out = complete(str(plain), [PROMPT], threshold=1.0, block_size=1, max_new_tokens=MAX_NEW)
    assert out[0]["tokens"] == transformers_greedy(hf, prompt_ids(), MAX_NEW)
    with pytest.raises(InputError, match="step: 3"):
        sources.load_model(str(plain), step=3)


def _snapshot(path) -> dict:
    """{relative path: (sha256, mode, mtime_ns)} of every file and folder under ``path``."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            st = os.lstat(full)
            digest = None
            if os.path.isfile(full):
                with open(full, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(full, path)] = (digest, st.st_mode, st.st_mtime_ns)
    return out


def test_a_model_directory_read_by_every_tool_stays_byte_for_byte(released, tmp_path):
    """evaluate (its report printed, or written to --output_dir), serve, lm-eval, generate and
    chat on a read-only Hugging Face directory (read-only for a user that is not root; root may
    write anywhere, so the snapshot decides): not a byte, mode or time of it changes."""
    hf, source = released
    path = str(tmp_path / "model")
    shutil.copytree(source, path)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o555 if name in dirs else 0o444)
    os.chmod(path, 0o555)
    before = _snapshot(path)
    cfg = tiny_config(
        "mars",
        eval__block_size=4,
        eval__num_examples=2,
        eval__batch_size=2,
        eval__max_new_tokens=6,
        eval__thresholds=(1.0, 0.5),
        eval__nll_examples=2,
        eval__timing_repeats=1,
    )
    report = evaluate.evaluate(cfg, path)  # printed only
    assert (report["step"], report["block_size"], report["num_examples"]) == (0, 4, 2)
    report = evaluate.evaluate(cfg, path, output_dir=str(tmp_path / "report"))
    assert (
        json.loads((tmp_path / "report" / "eval.json").read_text())["results"] == report["results"]
    )

    opened = sources.open(path, block_size=4)
    options = opened.options(max_new_tokens=MAX_NEW, threshold=1.0)
    server = serve.make_server(opened, options, slots=2, max_prompt_len=64, max_waiting=4)
    try:
        stream = server.engine.submit(
            engine.Request(tuple(prompt_ids()), max_tokens=MAX_NEW, threshold=1.0)
        )
        tokens, _ = stream.result(timeout=300)
    finally:
        server.engine.stop()
    greedy = transformers_greedy(hf, prompt_ids(), MAX_NEW)
    assert tokens == greedy
    out = complete(path, [PROMPT], block_size=4, threshold=1.0, max_new_tokens=MAX_NEW)
    assert out[0]["tokens"] == greedy

    from mars_jax import chat
    from mars_jax.lm_eval_adapter import MarsLM

    lm = MarsLM.from_args(path, block_size=4, threshold=0.5)
    assert (lm.step, lm.decode_kwargs["block_size"], lm.decode_kwargs["mask_id"]) == (0, 4, MASK_ID)
    session = chat.Session(opened, opened.options(max_new_tokens=2), width=64)
    assert session.turn("Hi")["tokens"]
    assert _snapshot(path) == before
