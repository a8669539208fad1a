"""Tests of mars_jax.tokenizer against the real Qwen2 tokenizer files, GSM8K text and transformers."""

import json
import shutil
from pathlib import Path

import pytest

from mars_jax import tokenizer as T

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
QWEN2_DIR = DATA / "qwen2-tokenizer"
GSM8K_TEST = DATA / "gsm8k" / "test.jsonl"

needs_qwen2 = pytest.mark.skipif(
    not (QWEN2_DIR / "vocab.json").exists(), reason=f"{QWEN2_DIR} absent"
)
needs_gsm8k = pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"{GSM8K_TEST} absent")


@pytest.fixture(scope="module")
def offline():
    return T.load_tokenizer(None)


@pytest.fixture(scope="module")
def qwen2():
    return T.load_tokenizer(str(QWEN2_DIR))


@pytest.fixture(scope="module")
def gsm8k():
    return [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]


def hf_tokenizer(directory):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def hf_chat_ids(hf, messages, add_generation_prompt):
    out = hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    return list(
        out["input_ids"] if hasattr(out, "keys") else out
    )  # transformers 5 returns a BatchEncoding


def conversations(rows):
    """No system turn, a system turn, and several turns, built from GSM8K questions and answers."""
    q = [r["question"] for r in rows]
    a = [r["answer"] for r in rows]
    return [
        [{"role": "user", "content": q[0]}],
        [
            {"role": "system", "content": "Solve the math problem step by step."},
            {"role": "user", "content": q[1]},
        ],
        [
            {"role": "system", "content": "You are a careful tutor."},
            {"role": "user", "content": q[2]},
            {"role": "assistant", "content": a[2]},
            {"role": "user", "content": q[3]},
            {"role": "assistant", "content": a[3]},
            {"role": "user", "content": q[4]},
        ],
        [{"role": "user", "content": q[5]}, {"role": "assistant", "content": a[5]}],
    ]


@needs_qwen2
@needs_gsm8k
def test_offline_default_matches_vocab_merges_on_all_gsm8k(offline, qwen2, gsm8k):
    texts = [r["question"] for r in gsm8k] + [r["answer"] for r in gsm8k]
    assert len(texts) == 2 * 1319
    ours = offline.encode_batch(texts)
    assert ours == qwen2.encode_batch(texts)
    assert ours[0] == offline.encode(texts[0])
    assert sum(map(len, ours)) > 100_000
    assert offline.decode(ours[-1]) == texts[-1]


@needs_qwen2
@needs_gsm8k
def test_vocab_merges_matches_transformers_on_gsm8k(qwen2, gsm8k):
    hf = hf_tokenizer(QWEN2_DIR)
    texts = [r["question"] for r in gsm8k[:300]] + [r["answer"] for r in gsm8k[:300]]
    assert qwen2.encode_batch(texts) == [hf.encode(t, add_special_tokens=False) for t in texts]


@needs_qwen2
@needs_gsm8k
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_ids_match_transformers(qwen2, gsm8k, add_generation_prompt):
    hf = hf_tokenizer(QWEN2_DIR)
    assert qwen2.chat_template == hf.chat_template
    for messages in conversations(gsm8k):
        ours = qwen2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert ours == hf_chat_ids(hf, messages, add_generation_prompt)
        if (
            messages[-1]["role"] == "user"
        ):  # the shared Qwen2 template opens an assistant turn after each user turn
            assert ours[-3:] == [T.IM_START_ID, 77091, 198]
        assert qwen2.encode(qwen2.render_chat(messages, add_generation_prompt)) == ours


def test_special_ids(offline):
    assert len(offline) == 151666
    assert (offline.pad_id, offline.bos_id, offline.eos_id, offline.mask_id) == (
        151643,
        151643,
        151645,
        151665,
    )
    assert T.MASK_ID == offline.mask_id and T.MASK_TOKEN == "<|mask|>"
    assert [i for i, _, _ in T.CONTROL_TOKENS] == list(range(151643, 151665))
    for token_id, text, _ in [*T.CONTROL_TOKENS, (T.MASK_ID, T.MASK_TOKEN, True)]:
        assert offline.encode(text) == [token_id]
        assert offline.decode([token_id], skip_special_tokens=False) == text
    ids = offline.encode("x<|mask|><|mask|>y<|im_end|>")
    assert ids == [87, 151665, 151665, 88, 151645]
    assert offline.decode(ids) == "xy"
    assert offline.encode("Hello world") == [9707, 1879]


@needs_qwen2
def test_qwen2_dir_reads_its_own_control_tokens(qwen2):
    """Qwen2's files declare three control tokens: nothing of Qwen2.5's layout is forced on them,
    and <|mask|> goes right after them."""
    assert len(qwen2) == 151647
    assert (qwen2.pad_id, qwen2.eos_id, qwen2.eos_ids) == (151643, 151645, (151645,))
    assert (qwen2.mask_id, qwen2.mask_declared) == (151646, False)
    assert qwen2.encode("<|im_start|><|im_end|><|mask|>") == [151644, 151645, 151646]
    assert len(qwen2.encode("<|object_ref_start|>")) > 1  # a Qwen2.5 token: text here


def test_offline_default_renders_qwen25_template(offline):
    user = [{"role": "user", "content": "What is 2+3?"}]
    assert offline.render_chat(user, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    chat = [
        {"role": "system", "content": "Be brief."},
        *user,
        {"role": "assistant", "content": "5"},
    ]
    text = offline.render_chat(chat)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
    )
    assert "Alibaba" not in text
    ids = offline.apply_chat_template(chat)
    assert ids[:3] == [151644, 8948, 198] and ids[-2:] == [151645, 198]


@needs_gsm8k
def test_save_round_trip_through_transformers(offline, gsm8k, tmp_path):
    offline.save(str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]["151665"]["content"] == "<|mask|>"
    assert (config["eos_token"], config["pad_token"]) == ("<|im_end|>", "<|endoftext|>")
    hf = hf_tokenizer(tmp_path)
    assert len(hf) == 151666
    assert hf.convert_tokens_to_ids("<|mask|>") == 151665
    texts = ["<|mask|>", "a <|mask|>b<|im_end|>\n", *[r["answer"] for r in gsm8k[:50]]]
    assert [hf.encode(t, add_special_tokens=False) for t in texts] == offline.encode_batch(texts)
    for messages in conversations(gsm8k):
        for gen in (False, True):
            assert hf_chat_ids(hf, messages, gen) == offline.apply_chat_template(messages, gen)
    reloaded = T.load_tokenizer(str(tmp_path))  # tokenizer.json source
    assert reloaded.chat_template == offline.chat_template
    assert reloaded.encode_batch(texts) == offline.encode_batch(texts)


def test_chat_template_jinja_file_wins(offline, tmp_path):
    offline.save(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    tok = T.load_tokenizer(str(tmp_path))
    assert (
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        == "[a][b]"
    )


@pytest.mark.parametrize("trims", [False, True])
def test_continue_final_message_leaves_the_turn_open_as_transformers(offline, tmp_path, trims):
    """lm_eval's gen_prefix: the chat ends inside the assistant's opening words, as transformers'
    continue_final_message renders it, with a template that keeps content and one that trims it."""
    offline.save(str(tmp_path))
    if trims:
        (tmp_path / "chat_template.jinja").write_text(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}"
        )
    ours, hf = T.load_tokenizer(str(tmp_path)), hf_tokenizer(tmp_path)
    for prefix in ("The best answer is", "The best answer is ", "```python\n"):
        chat = [
            {"role": "user", "content": "Which is larger, 3 or 5?<|mask|>"},
            {"role": "assistant", "content": prefix},
        ]
        text = ours.render_chat(chat, continue_final_message=True)
        assert text == hf.apply_chat_template(chat, tokenize=False, continue_final_message=True)
        assert text.endswith(prefix.rstrip() if trims else prefix)
        ids = ours.apply_chat_template(chat, continue_final_message=True)
        assert (
            ours.decode(ids, False) == text and T.MASK_ID not in ids
        )  # the spelled mask stays text
    with pytest.raises(T.InputError, match="last message must have text content"):
        ours.render_chat(chat, add_generation_prompt=True, continue_final_message=True)


def test_conflicting_special_token_in_config_raises(offline, tmp_path):
    offline.save(str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["151644"]["content"] = "<|start|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"tokenizer_config\.json: id 151644 is '<\|start\|>', but .*tokenizer\.json",
    ):
        T.load_tokenizer(str(tmp_path))


@needs_qwen2
def test_a_gap_in_the_added_ids_raises(tmp_path):
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(QWEN2_DIR / name, tmp_path / name)
    config = json.loads((QWEN2_DIR / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["151650"] = {"content": "<|other|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"cannot add '<\|other\|>' at id 151650: ids before"):
        T.load_tokenizer(str(tmp_path))


def test_a_role_naming_no_token_raises(offline, tmp_path):
    offline.save(str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["pad_token"] = "<|pad|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"pad_token '<\|pad\|>' is not a token of"):
        T.load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("declared", [False, True])
def test_mask_goes_past_the_ids_of_a_qwen3_like_tokenizer(offline, tmp_path, declared):
    """Qwen3's tokenizer has <tool_response>, </tool_response>, <think>, </think> at 151665-8:
    <|mask|> is read where the files declare it, else added past every id, never over them."""
    offline.save(str(tmp_path))
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != T.MASK_TOKEN]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    qwen3 = ["<tool_response>", "</tool_response>", "<think>", "</think>"]
    config["added_tokens_decoder"] = {
        k: v for k, v in config["added_tokens_decoder"].items() if int(k) < T.MASK_ID
    }
    for i, text in enumerate(qwen3 + ([T.MASK_TOKEN] if declared else [])):
        config["added_tokens_decoder"][str(T.MASK_ID + i)] = {"content": text, "special": True}
    config.pop("mask_token")
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = T.load_tokenizer(str(tmp_path))
    assert (tok.mask_id, tok.mask_declared) == (151669, declared)
    assert tok.encode("<think><|mask|>") == [151667, 151669]
    assert (
        offline.mask_declared is False and T.load_tokenizer(str(tmp_path)).mask_declared == declared
    )


def test_another_familys_tokenizer_must_name_its_end_of_turn(tmp_path):
    """A BPE without Qwen's control tokens is read as another family's (Llama 3:
    tests/model/test_model_families.py), with its own control tokens; without an eos_token in
    tokenizer_config.json it is refused by file and field, not read with Qwen's ids."""
    import tokenizers

    vocab = {f"t{i}": i for i in range(300)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.add_special_tokens(["<|begin_of_text|>", "<|eot_id|>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: no eos_token"):
        T.load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match=r"eos_token '<\|nope\|>' is not a token"):
        T.load_tokenizer(str(tmp_path))
