"""Tests of mars_jax.data and mars_jax.synthetic against the real Qwen2.5 tokenizer and GSM8K."""

import json
import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mars_jax import data
from mars_jax.synthetic import arithmetic_problems
from mars_jax.tokenizer import ENDOFTEXT_ID, IM_END_ID, load_tokenizer

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
GSM8K = SHARED_DATA / "gsm8k"
IM_START_ID = 151644
BS = 32


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def gsm8k_train():
    if not (GSM8K / "train.jsonl").exists():
        pytest.skip(f"GSM8K data not found at {GSM8K}")
    return data.read_rows(GSM8K / "train.jsonl")


def labelled_text(tok, labels):
    return tok.decode(labels[labels != data.IGNORE_INDEX], skip_special_tokens=False)


def chat(tok, messages, **kw):
    return data.tokenize_chat(tok, messages, **{"max_length": 512, "block_size": BS, **kw})


def test_gsm8k_train_set(tok, gsm8k_train):
    start = time.perf_counter()
    examples, skips = data.build_examples(
        gsm8k_train, tok, "gsm8k", max_length=512, block_size=BS, source_name="gsm8k/train"
    )
    elapsed = time.perf_counter() - start
    assert not skips and len(examples) == len(gsm8k_train) == 7473
    assert elapsed < 30, f"tokenizing GSM8K train took {elapsed:.1f}s"
    for ids, labels in examples:
        assert ids.dtype == labels.dtype == np.int32 and len(ids) == len(labels)
        assert len(ids) % BS == 0 and ids[0] == IM_START_ID
    for index in (0, 1, 4321, 7472):
        row, (ids, labels) = gsm8k_train[index], examples[index]
        messages = data.rows_to_messages(row, "gsm8k")
        first = int(np.argmax(labels != data.IGNORE_INDEX))
        # The prompt is exactly what decoding feeds the model; the last prompt token is the "\n"
        # after <|im_start|>assistant.
        prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True)
        assert ids[:first].tolist() == prompt
        assert ids[first - 1] == tok.encode("\n")[0] and ids[first - 3] == IM_START_ID
        assert tok.decode(ids[first - 2 : first]) == "assistant\n"
        # The full conversation without the template's trailing "\n", then labelled EOS padding.
        full = tok.apply_chat_template(messages)
        assert tok.decode(full[-1:]) == "\n"
        n = len(full) - 1
        assert labelled_text(tok, labels[:n]) == row["answer"] + "<|im_end|>"
        assert ids[:n].tolist() == full[:-1] and (labels[first:n] == ids[first:n]).all()
        assert len(ids) - n < BS and (ids[n:] == IM_END_ID).all() and (labels[n:] == IM_END_ID).all()
        assert (labels[:first] == data.IGNORE_INDEX).all()


MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5.\n#### 5"},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "5 * 4 = 20.\n#### 20"},
    {"role": "user", "content": "Thanks!"},
]


def test_multi_turn_labels_final_turn_or_all(tok):
    ids, labels = chat(tok, MULTI)
    content_end = int(np.flatnonzero(ids == IM_END_ID)[4]) + 1  # system, user, asst, user, asst
    assert ids[:content_end].tolist() == tok.apply_chat_template(MULTI[:5])[:-1]
    assert labelled_text(tok, labels[:content_end]) == "5 * 4 = 20.\n#### 20<|im_end|>"
    assert (ids[content_end:] == IM_END_ID).all() and (labels[content_end:] == IM_END_ID).all()
    assert "Thanks" not in tok.decode(ids)
    all_ids, all_labels = chat(tok, MULTI, all_assistant_turns=True)
    np.testing.assert_array_equal(all_ids, ids)
    real = all_labels[:content_end]
    assert labelled_text(tok, real) == "2 + 3 = 5.\n#### 5<|im_end|>5 * 4 = 20.\n#### 20<|im_end|>"


def test_bos_only_when_first_token_labelled(tok, tmp_path):
    assert chat(tok, MULTI)[0][0] == IM_START_ID
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] + '<|im_end|>' }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    bare = load_tokenizer(str(tmp_path))
    ids, labels = chat(bare, [{"role": "assistant", "content": "#### 7"}])
    assert ids[0] == ENDOFTEXT_ID and labels[0] == data.IGNORE_INDEX
    answer = bare.encode("#### 7<|im_end|>")
    assert ids[1 : 1 + len(answer)].tolist() == answer and len(ids) == BS
    assert (labels[1:] == ids[1:]).all()


def test_qwen2_release_template(tok):
    if not (SHARED_DATA / "qwen2-tokenizer" / "vocab.json").exists():
        pytest.skip("qwen2-tokenizer not found")
    qwen2 = load_tokenizer(str(SHARED_DATA / "qwen2-tokenizer"))
    messages = data.rows_to_messages({"question": "Q?", "answer": "A.\n#### 1"}, "gsm8k")
    ids, labels = chat(qwen2, messages)
    assert labelled_text(qwen2, labels).startswith("A.\n#### 1<|im_end|>")
    first = int(np.argmax(labels != data.IGNORE_INDEX))
    assert ids[:first].tolist() == qwen2.apply_chat_template(messages[:-1], add_generation_prompt=True)


def test_truncation_keeps_surviving_labels(tok):
    messages = data.rows_to_messages({"question": "Count.", "answer": " ".join(["one"] * 100)}, "gsm8k")
    ids_full, labels_full = chat(tok, messages)
    first = int(np.argmax(labels_full != data.IGNORE_INDEX))
    ids, labels = chat(tok, messages, max_length=first + 8, block_size=first + 8)
    assert len(ids) == first + 8
    np.testing.assert_array_equal(ids, ids_full[: first + 8])
    np.testing.assert_array_equal(labels, labels_full[: first + 8])
    assert (labels[first:] != data.IGNORE_INDEX).sum() == 8
    with pytest.raises(data.SkipRow, match="prompt_too_long"):
        chat(tok, messages, max_length=first, block_size=first)


def test_length_arguments(tok):
    with pytest.raises(ValueError, match="multiple of block_size"):
        chat(tok, MULTI, max_length=100, block_size=32)
    with pytest.raises(ValueError, match="positive"):
        chat(tok, MULTI, max_length=0, block_size=32)


def test_skip_reasons_counted(tok):
    ok = {"role": "user", "content": "hi"}
    rows = [
        {"messages": [ok, {"role": "assistant", "content": "hello"}]},  # kept
        {"prompt": "no messages"},
        {"messages": [ok, {"role": "assistant"}]},
        {"messages": [ok, {"content": "hello"}]},
        {"messages": [ok, {"role": "assistant", "content": None}]},
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]},
        {"messages": [ok, {"role": "assistant", "content": ["hello"]}]},
        {"messages": [ok]},
        {"messages": [ok, {"role": "assistant", "content": " \n\t"}]},
        {"messages": [{"role": "user", "content": "word " * 600}, {"role": "assistant", "content": "x"}]},
    ]
    examples, skips = data.build_examples(
        rows, tok, "messages", max_length=128, block_size=BS, source_name="crafted"
    )
    assert len(examples) == 1
    assert skips == {
        "missing_field": 3,
        "none_content": 2,
        "non_string_content": 1,
        "no_assistant_turn": 1,
        "empty_answer": 1,
        "prompt_too_long": 1,
    }
    gsm = [
        {"question": "q"},
        {"question": None, "answer": "a"},
        {"question": "q", "answer": ""},
        {"question": "q", "answer": 3},
    ]
    _, skips = data.build_examples(gsm, tok, "gsm8k", max_length=128, block_size=BS)
    assert skips == {"missing_field": 1, "none_content": 1, "empty_answer": 1, "non_string_content": 1}
    assert "None" not in tok.decode(examples[0][0])


def test_special_strings_and_unrenderable_rows_are_skipped(tok):
    """A control-token string in content would cut the labelled turn at a fake <|im_end|> or
    put <|mask|> into the clean stream; a template that cannot render a row (the Qwen2 release
    template on an assistant-first row) must not stop the whole build."""
    user = {"role": "user", "content": "q"}
    rows = [
        {"messages": [user, {"role": "assistant", "content": "foo <|im_end|> bar"}]},
        {"messages": [user, {"role": "assistant", "content": "a <|mask|> b"}]},
        {"messages": [{"role": "user", "content": "<|endoftext|>"}, {"role": "assistant", "content": "x"}]},
        {"messages": [user, {"role": "assistant", "content": "fine"}]},
    ]
    examples, skips = data.build_examples(rows, tok, "messages", max_length=128, block_size=BS)
    assert skips == {"special_token_in_content": 3} and len(examples) == 1
    if not (SHARED_DATA / "qwen2-tokenizer" / "vocab.json").exists():
        pytest.skip("qwen2-tokenizer not found")
    qwen2 = load_tokenizer(str(SHARED_DATA / "qwen2-tokenizer"))
    rows = [{"messages": [{"role": "assistant", "content": "a"}]}, rows[-1]]
    examples, skips = data.build_examples(rows, qwen2, "messages", max_length=128, block_size=BS)
    assert skips == {"template_error": 1} and len(examples) == 1


def test_max_label_tokens(tok):
    rows = [{"question": "q", "answer": "short"}, {"question": "q", "answer": "a much longer answer " * 20}]
    examples, _ = data.build_examples(
        rows[:1], tok, "gsm8k", max_length=256, block_size=BS, max_label_tokens=BS
    )
    assert len(examples) == 1
    with pytest.raises(ValueError, match=r"mine: row 1 has \d+ labelled tokens"):
        data.build_examples(
            rows, tok, "gsm8k", max_length=256, block_size=BS, max_label_tokens=BS, source_name="mine"
        )


def test_read_rows_jsonl_and_parquet(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"question": "a", "answer": "b"}\n\n{"question": "c", "answer": "d"}\n')
    assert data.read_rows(good) == [{"question": "a", "answer": "b"}, {"question": "c", "answer": "d"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "b"}\n{"question": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        data.read_rows(bad)
    bad.write_text('{"question": "a", "answer": "b"}\n\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: expected a JSON object"):
        data.read_rows(bad)
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    assert data.read_rows(tmp_path / "rows.parquet") == rows
    with pytest.raises(ValueError, match=r"\.jsonl, \.json or \.parquet"):
        data.read_rows(tmp_path / "rows.csv")


# Rows whose text has non-ASCII letters, an emoji (a surrogate pair in UTF-16), escaped and raw
# U+2028 (a line break to str.splitlines, plain text to JSON) and an escaped CRLF.
SAVED_ROWS = [
    {"question": "Combien coûte un café ?", "answer": "2 €\n#### 2"},
    {"question": "数学 🧮 a\u2028b", "answer": "x\r\ny\n#### 3"},
    {"question": "plain", "answer": "#### 4"},
]
SAVED_LINES = [json.dumps(r, ensure_ascii=False) for r in SAVED_ROWS]
SAVED_LINES[1] = SAVED_LINES[1].replace("\\u2028", "\u2028")  # a raw U+2028 inside a string


@pytest.mark.parametrize(
    "text, encoding",
    [
        ("\n".join(SAVED_LINES) + "\n", "utf-8"),
        ("\r\n".join(SAVED_LINES) + "\r\n", "utf-8"),  # Windows line endings
        ("\n".join(SAVED_LINES), "utf-8"),  # no newline after the last line
        ("\n \t\n".join(SAVED_LINES) + "\r\n\n   \n", "utf-8"),  # blank, whitespace-only lines
        ("\r".join(SAVED_LINES) + "\r", "utf-8"),  # old Mac line endings
        ("\r\n".join(SAVED_LINES) + "\r\n", "utf-8-sig"),  # Notepad's "UTF-8 with BOM"
        ("\r\n".join(SAVED_LINES) + "\r\n", "utf-16"),  # Notepad/PowerShell "Unicode": LE + BOM
        ("\ufeff" + "\n".join(SAVED_LINES), "utf-16-be"),  # "Unicode big endian"
        ("\ufeff" + "\n".join(SAVED_LINES), "utf-32-le"),
        (SAVED_LINES[0] + "\n\ufeff" + "\n\ufeff".join(SAVED_LINES[1:]), "utf-8-sig"),  # cat of BOM files
    ],
    ids=[
        "lf", "crlf", "no-final-newline", "blank-lines", "cr", "utf8-bom", "utf16le-bom",
        "utf16be-bom", "utf32le-bom", "cat-of-bom-files",
    ],
)
def test_read_rows_as_saved_by_editors_and_windows_tools(tmp_path, text, encoding):
    path = tmp_path / "saved.jsonl"
    path.write_bytes(text.encode(encoding))
    assert data.read_rows(path) == SAVED_ROWS


def test_read_rows_bad_bytes_name_file_line_and_offset(tmp_path):
    path = tmp_path / "bad.jsonl"
    line1 = SAVED_LINES[2].encode() + b"\r\n"
    line2 = '{"question": "Caf'.encode()
    path.write_bytes(line1 + line2 + "é?\", \"answer\": \"1\"}\r\n".encode("cp1252"))  # Excel's "ANSI"
    offset = len(line1) + len(line2)
    with pytest.raises(ValueError) as e:
        data.read_rows(path)
    message = str(e.value)
    assert message.startswith(f"{path}:2: invalid UTF-8 at byte offset {offset} (column 18)")
    assert "cp1252" in message and e.value.__cause__ is None  # no UnicodeDecodeError chained
    path.write_bytes((SAVED_LINES[2] + "\n" + SAVED_LINES[2]).encode("utf-16-le"))  # no BOM
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:1: NUL byte at byte offset 1 .*UTF-16"):
        data.read_rows(path)
    utf16 = ("\ufeff" + SAVED_LINES[2] + "\n" + SAVED_LINES[0]).encode("utf-16-le")
    path.write_bytes(utf16 + "🧮".encode("utf-16-le")[:2] + b"\n\x00")  # half an emoji
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: invalid UTF-16 LE at byte offset {len(utf16)} "):
        data.read_rows(path)


def test_read_rows_json_array_or_clear_error(tmp_path):
    pretty = json.dumps(SAVED_ROWS, ensure_ascii=False, indent=2).replace("\n", "\r\n")
    array = tmp_path / "rows.json"
    array.write_bytes(pretty.encode("utf-8-sig"))  # as a Windows tool saves a JSON export
    assert data.read_rows(array) == SAVED_ROWS
    array.write_text("\n".join(SAVED_LINES))  # many ".json" datasets are JSON Lines
    assert data.read_rows(array) == SAVED_ROWS
    upper = tmp_path / "ROWS.JSONL"  # Windows does not care about the extension's case
    upper.write_text("\n".join(SAVED_LINES))
    assert data.read_rows(upper) == SAVED_ROWS
    array.write_text('[\n  {"question": "a", "answer": "b"},\n  ["not", "a", "row"]\n]\n')
    with pytest.raises(ValueError, match=r"rows\.json:3: expected a JSON object, got list \(array element 1\)"):
        data.read_rows(array)
    array.write_text('[\r  {"question": "a", "answer": "b"},\r  {"question": }\r]')
    with pytest.raises(ValueError, match=r"rows\.json:3: invalid JSON"):
        data.read_rows(array)
    lines = tmp_path / "rows.jsonl"
    lines.write_text(pretty)
    with pytest.raises(ValueError, match=r"rows\.jsonl:1: invalid JSON: .*one JSON array.*\.json"):
        data.read_rows(lines)
    lines.write_text(json.dumps(SAVED_ROWS))
    with pytest.raises(ValueError, match=r"rows\.jsonl:1: expected a JSON object, got list.*\.json"):
        data.read_rows(lines)


def fake_examples(n, length=BS):
    return [(np.full(length, i, np.int32), np.full(length, i, np.int32)) for i in range(n)]


def first_ids(batch):
    return batch["input_ids"][:, 0].tolist()


def test_batched_dataset_shapes_and_padding():
    ds = data.batched_dataset(fake_examples(10), batch_size=4, max_length=3 * BS, seed=0, num_epochs=1)
    assert len(ds) == 2  # the partial batch is dropped
    batch = ds[0]
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 3 * BS)
    assert batch["input_ids"].dtype == batch["labels"].dtype == np.int32
    assert (batch["input_ids"][:, BS:] == ENDOFTEXT_ID).all()
    assert (batch["labels"][:, BS:] == data.IGNORE_INDEX).all()
    assert (batch["input_ids"][:, :BS] == batch["input_ids"][:, :1]).all()
    ds = data.batched_dataset(
        fake_examples(10),
        batch_size=4,
        max_length=BS,
        seed=0,
        num_epochs=1,
        shuffle=False,
        drop_remainder=False,
    )
    assert [first_ids(ds[i]) for i in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, ENDOFTEXT_ID, ENDOFTEXT_ID],
    ]
    assert (ds[2]["labels"][2:] == data.IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="more than max_length"):
        data.batched_dataset(fake_examples(4, 2 * BS), batch_size=2, max_length=BS, seed=0)
    with pytest.raises(ValueError, match="cannot fill"):
        data.batched_dataset(fake_examples(3), batch_size=4, max_length=BS, seed=0)


def first_ids_of_steps(ds, steps):
    return [i for step in steps for i in first_ids(ds[step])]


def test_batched_dataset_shuffling_epochs_and_resume():
    examples = fake_examples(12)
    ds = data.batched_dataset(examples, batch_size=4, max_length=BS, seed=7)
    epochs = [first_ids_of_steps(ds, range(3 * e, 3 * e + 3)) for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(12))  # every example once per epoch
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(12))
    again = data.batched_dataset(examples, batch_size=4, max_length=BS, seed=7)
    for step in (0, 5, 10_000_001):  # resuming at step s reads element s
        np.testing.assert_array_equal(again[step]["input_ids"], ds[step]["input_ids"])
    other = data.batched_dataset(examples, batch_size=4, max_length=BS, seed=8)
    assert first_ids_of_steps(other, range(3)) != epochs[0]
    finite = data.batched_dataset(examples, batch_size=4, max_length=BS, seed=7, num_epochs=2)
    assert len(finite) == 6 and first_ids(finite[4]) == first_ids(ds[4])


EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def test_synthetic_problems_are_correct_and_deterministic(tok):
    problems = arithmetic_problems(300, seed=0)
    assert problems == arithmetic_problems(300, seed=0)
    assert problems != arithmetic_problems(300, seed=1)
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}
    for p in problems:
        lines = p["answer"].split("\n")
        equations = [EQUATION.search(line) for line in lines[:-1]]
        assert all(equations) and 2 <= len(equations) <= 4, p
        for m in equations:
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            assert ops[op](a, b) == c and c >= 0 and (op != "/" or a % b == 0), p
        assert lines[-1] == f"#### {equations[-1][4]}"
    assert len({p["question"].split(" has ")[0] for p in problems}) >= 8
    lengths = [len(tok.encode(p["question"] + "\n" + p["answer"])) for p in problems]
    assert 60 <= np.mean(lengths) <= 90 and max(lengths) <= 130


def test_eval_examples(tok):
    synthetic = data.eval_examples("synthetic", num_examples=5, seed=3)
    assert len(synthetic) == 5
    expected = arithmetic_problems(5, seed=3)
    for (prompt, reference), p in zip(synthetic, expected):
        assert prompt == [{"role": "user", "content": p["question"]}] and reference == p["answer"]
    if not (GSM8K / "test.jsonl").exists():
        pytest.skip(f"GSM8K data not found at {GSM8K}")
    test_rows = data.read_rows(GSM8K / "test.jsonl")
    gsm = data.eval_examples(str(GSM8K / "test.jsonl"), num_examples=10)
    assert [p[0]["content"] for p, _ in gsm] == [r["question"] for r in test_rows[:10]]
    assert [ref for _, ref in gsm] == [r["answer"] for r in test_rows[:10]]
    assert all(ref.split("#### ")[-1].strip() for _, ref in gsm)
