"""Tokenizer directories of every layout this project meets, read from their own files and
checked against transformers' ``AutoTokenizer`` id for id: on text (GSM8K-like, with spelled
control tokens), on a rendered chat, and in the roles (EOS, pad, BOS, mask, size).

Layouts: SmolLM2-135M-Instruct (ChatML at ids 0-2 of a 49,152-id vocabulary that fills its
embedding), Qwen2 extended by a MARS fine-tune with ``<|mask|>`` right after its three control
tokens (151646), Qwen2.5 (our own saved layout), Qwen3 (``<think>`` tokens where Qwen2.5's mask
would go) and Llama 3 (its own control tokens, stop ids in generation_config.json)."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mars_jax.tokenizer import MASK_TOKEN, load_tokenizer
from tests.model.test_model_families import write_llama3_directory, write_qwen3_directory

QWEN2_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "qwen2-tokenizer"
TEXTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "  leading spaces, tabs\tand\nnewlines\n\n, digits 1234567 and unicode: café 東京 🙂",
    "<|im_start|>user\nspelled<|im_end|> control tokens <|endoftext|>",
]
CHAT = [
    {"role": "system", "content": "Solve the problem."},
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "content": "12 * 7 = 84.\n#### 84"},
    {"role": "user", "content": "And 13 * 7?"},
]


def _chat_ids(hf, messages, add_generation_prompt):
    out = hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    return list(out)


def assert_reads_as_transformers(directory, *, mask_declared: bool):
    """Our tokenizer of ``directory`` against transformers' on texts, chats and roles."""
    ours, hf = load_tokenizer(str(directory)), AutoTokenizer.from_pretrained(str(directory))
    for text in TEXTS:
        assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    for generation in (False, True):
        messages = CHAT if generation else CHAT[:3]
        assert ours.apply_chat_template(messages, generation, content_as_text=False) == _chat_ids(
            hf, messages, generation
        )
    assert ours.eos_id == hf.eos_token_id
    assert ours.pad_id == (hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id)
    if hf.bos_token_id is not None:
        assert ours.bos_id == hf.bos_token_id
    assert ours.mask_declared == mask_declared
    if mask_declared:
        assert ours.mask_id == hf.convert_tokens_to_ids(hf.mask_token or MASK_TOKEN)
        assert len(ours) == len(hf)
    else:  # added past every id, where transformers' add_special_tokens would put it
        assert (ours.mask_id, len(ours)) == (len(hf), len(hf) + 1)
    return ours, hf


@pytest.mark.real_model
def test_smollm2(smollm2_dir):
    ours, _ = assert_reads_as_transformers(smollm2_dir, mask_declared=False)
    assert (ours.eos_id, ours.pad_id, ours.bos_id, ours.eos_ids) == (2, 2, 1, (2,))
    assert ours.encode("<|endoftext|><|im_start|><|im_end|>") == [0, 1, 2]
    assert ours.mask_id == 49152  # past the 49,152 ids: a new embedding row (train adds it)


@pytest.mark.skipif(not (QWEN2_DIR / "vocab.json").exists(), reason=f"{QWEN2_DIR} absent")
def test_qwen2_with_the_mask_after_its_three_control_tokens(tmp_path):
    hf = AutoTokenizer.from_pretrained(str(QWEN2_DIR))
    hf.add_special_tokens({"mask_token": MASK_TOKEN})  # as a MARS fine-tune of Qwen2 does
    hf.save_pretrained(str(tmp_path))
    ours, hf = assert_reads_as_transformers(tmp_path, mask_declared=True)
    assert ours.mask_id == 151646 == hf.mask_token_id


def test_qwen25_as_our_runs_save_it(tmp_path):
    load_tokenizer(None).save(str(tmp_path))
    ours, _ = assert_reads_as_transformers(tmp_path, mask_declared=True)
    assert (ours.mask_id, ours.eos_id, ours.pad_id, ours.eos_ids) == (
        151665,
        151645,
        151643,
        (151645, 151643),
    )


def test_qwen3_layout(tmp_path):
    write_qwen3_directory(tmp_path)
    ours, _ = assert_reads_as_transformers(tmp_path, mask_declared=False)
    assert ours.mask_id == 151669 and ours.encode("<think>") == [151667]


def test_llama3_layout(tmp_path):
    write_llama3_directory(tmp_path / "llama")
    ours, _ = assert_reads_as_transformers(tmp_path / "llama", mask_declared=True)
    assert ours.eos_ids == (261, 257)  # <|eot_id|>, then generation_config.json's others


@pytest.mark.real_model
def test_a_saved_tokenizer_reads_back_the_same(smollm2_dir, tmp_path):
    """SmolLM2's tokenizer saved as a run saves it (the added mask included) reads back with
    the same ids and roles, and transformers reads the saved files the same way."""
    original = load_tokenizer(str(smollm2_dir))
    original.save(str(tmp_path))
    again, hf = assert_reads_as_transformers(tmp_path, mask_declared=True)
    assert (again.mask_id, again.eos_ids, again.pad_id, again.bos_id) == (
        original.mask_id,
        original.eos_ids,
        original.pad_id,
        original.bos_id,
    )
    assert hf.mask_token_id == original.mask_id
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [2]
