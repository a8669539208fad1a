"""Tests of mars_jax.rows, mars_jax.chat_rows, mars_jax.batches and mars_jax.synthetic against the real
Qwen2.5 tokenizer and GSM8K."""

import json
import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mars_jax.batches import Example, batched_dataset, build_examples, eval_examples
from mars_jax.chat_rows import SkipRow, rows_to_messages, tokenize_chat
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.rows import read_rows
from mars_jax.synthetic import arithmetic_problems
from mars_jax.tokenizer import CONTROL_TOKENS, ENDOFTEXT_ID, IM_END_ID, load_tokenizer

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
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
    return read_rows(GSM8K / "train.jsonl")


def labelled_text(tok, labels):
    return tok.decode(labels[labels != IGNORE_INDEX], skip_special_tokens=False)


def chat(tok, messages, **kw):
    return tokenize_chat(tok, messages, **{"max_length": 512, "block_size": BS, **kw})


def test_gsm8k_train_set(tok, gsm8k_train):
    start = time.perf_counter()
    examples, skips = build_examples(
        gsm8k_train, tok, "gsm8k", max_length=512, block_size=BS, source_name="gsm8k/train"
    )
    elapsed = time.perf_counter() - start
    assert not skips and len(examples) == len(gsm8k_train) == 7473
    assert elapsed < 30, f"tokenizing GSM8K train took {elapsed:.1f}s"
    for ids, labels, _ in examples:
        assert ids.dtype == labels.dtype == np.int32 and len(ids) == len(labels)
        assert len(ids) % BS == 0 and ids[0] == IM_START_ID
    for index in (0, 1, 4321, 7472):
        row, (ids, labels, _) = gsm8k_train[index], examples[index]
        messages = rows_to_messages(row, "gsm8k")
        first = int(np.argmax(labels != IGNORE_INDEX))
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
        assert (
            len(ids) - n < BS and (ids[n:] == IM_END_ID).all() and (labels[n:] == IM_END_ID).all()
        )
        assert (labels[:first] == IGNORE_INDEX).all()


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
    assert ids[0] == ENDOFTEXT_ID and labels[0] == IGNORE_INDEX
    answer = bare.encode("#### 7<|im_end|>")
    assert ids[1 : 1 + len(answer)].tolist() == answer and len(ids) == BS
    assert (labels[1:] == ids[1:]).all()


def test_qwen2_release_template(tok):
    if not (SHARED_DATA / "qwen2-tokenizer" / "vocab.json").exists():
        pytest.skip("qwen2-tokenizer not found")
    qwen2 = load_tokenizer(str(SHARED_DATA / "qwen2-tokenizer"))
    messages = rows_to_messages({"question": "Q?", "answer": "A.\n#### 1"}, "gsm8k")
    ids, labels = chat(qwen2, messages)
    assert labelled_text(qwen2, labels).startswith("A.\n#### 1<|im_end|>")
    first = int(np.argmax(labels != IGNORE_INDEX))
    assert ids[:first].tolist() == qwen2.apply_chat_template(
        messages[:-1], add_generation_prompt=True
    )


def test_truncation_keeps_surviving_labels(tok):
    messages = rows_to_messages({"question": "Count.", "answer": " ".join(["one"] * 100)}, "gsm8k")
    ids_full, labels_full = chat(tok, messages)
    first = int(np.argmax(labels_full != IGNORE_INDEX))
    ids, labels = chat(tok, messages, max_length=first + 8, block_size=first + 8)
    assert len(ids) == first + 8
    np.testing.assert_array_equal(ids, ids_full[: first + 8])
    np.testing.assert_array_equal(labels, labels_full[: first + 8])
    assert (labels[first:] != IGNORE_INDEX).sum() == 8
    with pytest.raises(SkipRow, match="prompt_too_long"):
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
        {
            "messages": [
                {"role": "user", "content": "word " * 600},
                {"role": "assistant", "content": "x"},
            ]
        },
    ]
    examples, skips = build_examples(
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
    _, skips = build_examples(gsm, tok, "gsm8k", max_length=128, block_size=BS)
    assert skips == {
        "missing_field": 1,
        "none_content": 1,
        "empty_answer": 1,
        "non_string_content": 1,
    }
    assert "None" not in tok.decode(examples[0][0])


def test_special_strings_and_unrenderable_rows_are_skipped(tok):
    """A control-token string in content would cut the labelled turn at a fake <|im_end|> or
    put <|mask|> into the clean stream; a template that cannot render a row (the Qwen2 release
    template on an assistant-first row) must not stop the whole build."""
    user = {"role": "user", "content": "q"}
    rows = [
        {"messages": [user, {"role": "assistant", "content": "foo <|im_end|> bar"}]},
        {"messages": [user, {"role": "assistant", "content": "a <|mask|> b"}]},
        {
            "messages": [
                {"role": "user", "content": "<|endoftext|>"},
                {"role": "assistant", "content": "x"},
            ]
        },
        {"messages": [user, {"role": "assistant", "content": "fine"}]},
    ]
    examples, skips = build_examples(rows, tok, "messages", max_length=128, block_size=BS)
    assert skips == {"special_token_in_content": 3} and len(examples) == 1
    if not (SHARED_DATA / "qwen2-tokenizer" / "vocab.json").exists():
        pytest.skip("qwen2-tokenizer not found")
    qwen2 = load_tokenizer(str(SHARED_DATA / "qwen2-tokenizer"))
    rows = [{"messages": [{"role": "assistant", "content": "a"}]}, rows[-1]]
    examples, skips = build_examples(rows, qwen2, "messages", max_length=128, block_size=BS)
    assert skips == {"template_error": 1} and len(examples) == 1


def test_max_label_tokens(tok):
    rows = [
        {"question": "q", "answer": "short"},
        {"question": "q", "answer": "a much longer answer " * 20},
    ]
    examples, _ = build_examples(
        rows[:1], tok, "gsm8k", max_length=256, block_size=BS, max_label_tokens=BS
    )
    assert len(examples) == 1
    with pytest.raises(ValueError, match=r"mine: row 1 has \d+ labelled tokens"):
        build_examples(
            rows,
            tok,
            "gsm8k",
            max_length=256,
            block_size=BS,
            max_label_tokens=BS,
            source_name="mine",
        )


def test_read_rows_jsonl_and_parquet(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"question": "a", "answer": "b"}\n\n{"question": "c", "answer": "d"}\n')
    assert read_rows(good) == [{"question": "a", "answer": "b"}, {"question": "c", "answer": "d"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "b"}\n{"question": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        read_rows(bad)
    bad.write_text('{"question": "a", "answer": "b"}\n\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: expected a JSON object"):
        read_rows(bad)
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    assert read_rows(tmp_path / "rows.parquet") == rows
    with pytest.raises(ValueError, match=r"\.jsonl, \.json or \.parquet"):
        read_rows(tmp_path / "rows.csv")


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
        (
            SAVED_LINES[0] + "\n\ufeff" + "\n\ufeff".join(SAVED_LINES[1:]),
            "utf-8-sig",
        ),  # cat of BOM files
    ],
    ids=[
        "lf",
        "crlf",
        "no-final-newline",
        "blank-lines",
        "cr",
        "utf8-bom",
        "utf16le-bom",
        "utf16be-bom",
        "utf32le-bom",
        "cat-of-bom-files",
    ],
)
def test_read_rows_as_saved_by_editors_and_windows_tools(tmp_path, text, encoding):
    path = tmp_path / "saved.jsonl"
    path.write_bytes(text.encode(encoding))
    assert read_rows(path) == SAVED_ROWS


def test_read_rows_bad_bytes_name_file_line_and_offset(tmp_path):
    path = tmp_path / "bad.jsonl"
    line1 = SAVED_LINES[2].encode() + b"\r\n"
    line2 = '{"question": "Caf'.encode()
    path.write_bytes(line1 + line2 + 'é?", "answer": "1"}\r\n'.encode("cp1252"))  # Excel's "ANSI"
    offset = len(line1) + len(line2)
    with pytest.raises(ValueError) as e:
        read_rows(path)
    message = str(e.value)
    assert message.startswith(f"{path}:2: invalid UTF-8 at byte offset {offset} (column 18)")
    assert "cp1252" in message and e.value.__cause__ is None  # no UnicodeDecodeError chained
    path.write_bytes((SAVED_LINES[2] + "\n" + SAVED_LINES[2]).encode("utf-16-le"))  # no BOM
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(path))}:1: NUL byte at byte offset 1 .*UTF-16"
    ):
        read_rows(path)
    utf16 = ("\ufeff" + SAVED_LINES[2] + "\n" + SAVED_LINES[0]).encode("utf-16-le")
    path.write_bytes(utf16 + "🧮".encode("utf-16-le")[:2] + b"\n\x00")  # half an emoji
    with pytest.raises(
        ValueError, match=rf"bad\.jsonl:2: invalid UTF-16 LE at byte offset {len(utf16)} "
    ):
        read_rows(path)


def test_read_rows_json_array_or_clear_error(tmp_path):
    pretty = json.dumps(SAVED_ROWS, ensure_ascii=False, indent=2).replace("\n", "\r\n")
    array = tmp_path / "rows.json"
    array.write_bytes(pretty.encode("utf-8-sig"))  # as a Windows tool saves a JSON export
    assert read_rows(array) == SAVED_ROWS
    array.write_text("\n".join(SAVED_LINES))  # many ".json" datasets are JSON Lines
    assert read_rows(array) == SAVED_ROWS
    upper = tmp_path / "ROWS.JSONL"  # Windows does not care about the extension's case
    upper.write_text("\n".join(SAVED_LINES))
    assert read_rows(upper) == SAVED_ROWS
    array.write_text('[\n  {"question": "a", "answer": "b"},\n  ["not", "a", "row"]\n]\n')
    with pytest.raises(
        ValueError, match=r"rows\.json:3: expected a JSON object, got list \(array element 1\)"
    ):
        read_rows(array)
    array.write_text('[\r  {"question": "a", "answer": "b"},\r  {"question": }\r]')
    with pytest.raises(ValueError, match=r"rows\.json:3: invalid JSON"):
        read_rows(array)
    array.write_text(json.dumps({"rows": SAVED_ROWS}, indent=2))
    with pytest.raises(
        ValueError, match=r"rows\.json:1: invalid JSON: .*JSON array of objects, or JSON Lines"
    ):
        read_rows(array)
    lines = tmp_path / "rows.jsonl"
    lines.write_text(pretty)
    with pytest.raises(ValueError, match=r"rows\.jsonl:1: invalid JSON: .*one JSON array.*\.json"):
        read_rows(lines)
    lines.write_text(json.dumps(SAVED_ROWS))
    with pytest.raises(
        ValueError, match=r"rows\.jsonl:1: expected a JSON object, got list.*\.json"
    ):
        read_rows(lines)


def fake_examples(n, length=BS):
    return [
        Example(np.full(length, i, np.int32), np.full(length, i, np.int32), row=i) for i in range(n)
    ]


def first_ids(batch):
    return batch["input_ids"][:, 0].tolist()


def test_batched_dataset_shapes_and_padding():
    ds = batched_dataset(fake_examples(10), batch_size=4, max_length=3 * BS, seed=0, num_epochs=1)
    assert len(ds) == 2  # the partial batch is dropped
    batch = ds[0]
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 3 * BS)
    assert batch["input_ids"].dtype == batch["labels"].dtype == np.int32
    assert (batch["input_ids"][:, BS:] == ENDOFTEXT_ID).all()
    assert (batch["labels"][:, BS:] == IGNORE_INDEX).all()
    assert (batch["input_ids"][:, :BS] == batch["input_ids"][:, :1]).all()
    ds = batched_dataset(
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
    assert (ds[2]["labels"][2:] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="more than max_length"):
        batched_dataset(fake_examples(4, 2 * BS), batch_size=2, max_length=BS, seed=0)
    with pytest.raises(ValueError, match="cannot fill"):
        batched_dataset(fake_examples(3), batch_size=4, max_length=BS, seed=0)


def first_ids_of_steps(ds, steps):
    return [i for step in steps for i in first_ids(ds[step])]


def test_batched_dataset_shuffling_epochs_and_resume():
    examples = fake_examples(12)
    ds = batched_dataset(examples, batch_size=4, max_length=BS, seed=7)
    epochs = [first_ids_of_steps(ds, range(3 * e, 3 * e + 3)) for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(12))  # every example once per epoch
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(12))
    again = batched_dataset(examples, batch_size=4, max_length=BS, seed=7)
    for step in (0, 5, 10_000_001):  # resuming at step s reads element s
        np.testing.assert_array_equal(again[step]["input_ids"], ds[step]["input_ids"])
    other = batched_dataset(examples, batch_size=4, max_length=BS, seed=8)
    assert first_ids_of_steps(other, range(3)) != epochs[0]
    finite = batched_dataset(examples, batch_size=4, max_length=BS, seed=7, num_epochs=2)
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
    synthetic = eval_examples("synthetic", num_examples=5, seed=3)
    assert len(synthetic) == 5
    expected = arithmetic_problems(5, seed=3)
    for (prompt, reference), p in zip(synthetic, expected):
        assert prompt == [{"role": "user", "content": p["question"]}] and reference == p["answer"]
    if not (GSM8K / "test.jsonl").exists():
        pytest.skip(f"GSM8K data not found at {GSM8K}")
    test_rows = read_rows(GSM8K / "test.jsonl")
    gsm = eval_examples(str(GSM8K / "test.jsonl"), num_examples=10)
    assert [p[0]["content"] for p, _ in gsm] == [r["question"] for r in test_rows[:10]]
    assert [ref for _, ref in gsm] == [r["answer"] for r in test_rows[:10]]
    assert all(ref.split("#### ")[-1].strip() for _, ref in gsm)


# A chat template in Qwen2.5-Instruct's tool-use format (written for these tests): the tools'
# JSON schemas in the system turn, an assistant turn's calls as <tool_call> JSON blocks after its
# optional content, and consecutive tool results as <tool_response> blocks in one user turn. It
# also writes a result's tool_call_id and name, to show that those fields reach the template.
TOOL_TEMPLATE = """
{%- if messages and messages[0].role == 'system' %}
    {%- set system_text = messages[0].content %}
{%- else %}
    {%- set system_text = 'You are a helpful assistant.' %}
{%- endif %}
{{- '<|im_start|>system\\n' + system_text }}
{%- if tools %}
    {{- '\\n\\nFunctions you can call, as JSON schemas:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\nTo call one, write {"name": ..., "arguments": {...}} in <tool_call> tags.' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- if call.function is defined %}
                {%- set call = call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {{- (call.arguments | tojson) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response' }}
        {%- if message.tool_call_id is defined %}
            {{- ' id="' + message.tool_call_id + '"' }}
        {%- endif %}
        {%- if message.name is defined %}
            {{- ' name="' + message.name + '"' }}
        {%- endif %}
        {{- '>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif not (loop.first and message.role == 'system') %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current temperature of a city, in °C.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def weather_call(call_id, city, arguments=None):
    arguments = {"city": city} if arguments is None else arguments
    function = {"name": "get_weather", "arguments": arguments}
    return {"id": call_id, "type": "function", "function": function}


def weather_chat(*, content="", arguments=json.loads, final=True):
    """Two calls in one assistant turn (content `content`), their results, and an answer (if
    `final`); `arguments(text)` turns the JSON text of each call's arguments into what the row
    stores (json.loads: a dict; str: OpenAI's string)."""
    calls = [
        weather_call("call_1", "Paris", arguments('{"city": "Paris"}')),
        weather_call("call_2", "Zürich", arguments('{"city": "Zürich"}')),
    ]
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "How warm is it in Paris and in Zürich?"},
        {"role": "assistant", "content": content, "tool_calls": calls},
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "name": "get_weather",
            "content": '{"temp": 21}',
        },
        {
            "role": "tool",
            "tool_call_id": "call_2",
            "name": "get_weather",
            "content": '{"temp": 15}',
        },
        {"role": "assistant", "content": "Paris: 21 °C, Zürich: 15 °C."},
    ]
    return messages if final else messages[:3]


TOOL_CALL_ID = 151657  # <tool_call>
CALLS_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>'
)


def tool_example(tokenizer, messages, tools=TOOLS, **kw):
    """(input_ids, labels) of the row `{"messages": messages, "tools": tools}`; SkipRow if it is
    skipped."""
    rows = [{"messages": messages, "tools": tools}]
    examples, skips = build_examples(
        rows, tokenizer, "messages", **{"max_length": 512, "block_size": BS, **kw}
    )
    if skips:
        raise SkipRow(*skips)
    return examples[0][:2]


@pytest.fixture(scope="module")
def tool_tok(tok, tmp_path_factory):
    """The offline tokenizer with TOOL_TEMPLATE."""
    directory = tmp_path_factory.mktemp("tool_tok")
    tok.save(str(directory))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(str(directory))


def test_tool_calls_match_transformers(tmp_path):
    """The real Qwen2 tokenizer files with the Qwen2.5 control tokens and TOOL_TEMPLATE, loaded
    by us and by transformers: a tool-use row tokenizes to transformers' apply_chat_template(...,
    tools=...) ids, and the tool-call turn is labelled with its <tool_call> blocks."""
    if not (SHARED_DATA / "qwen2-tokenizer" / "vocab.json").exists():
        pytest.skip("qwen2-tokenizer not found")
    transformers = pytest.importorskip("transformers")
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_bytes((SHARED_DATA / "qwen2-tokenizer" / name).read_bytes())
    config = json.loads((SHARED_DATA / "qwen2-tokenizer" / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {  # as a Qwen2.5 release declares them
        str(i): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, text, special in CONTROL_TOKENS
    }
    config["chat_template"] = TOOL_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))

    def hf_ids(messages, add_generation_prompt=False):
        out = hf.apply_chat_template(
            messages, tools=TOOLS, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    messages = weather_chat(content="Let me look.")
    ids, labels = tool_example(ours, messages, all_assistant_turns=True)
    full = hf_ids(messages)
    assert ours.decode(full[-1:]) == "\n"
    assert full.count(TOOL_CALL_ID) == 3  # the system turn's instruction and the two calls
    n = len(full) - 1  # the sequence ends at the final <|im_end|>, then labelled EOS padding
    assert ids[:n].tolist() == full[:-1] and (ids[n:] == IM_END_ID).all()
    first = int(np.argmax(labels != IGNORE_INDEX))
    assert ids[:first].tolist() == hf_ids(messages[:2], add_generation_prompt=True)
    assert '<tool_response id="call_2" name="get_weather">' in ours.decode(ids[:n])
    assert labelled_text(ours, labels[:n]) == (
        "Let me look.\n" + CALLS_TEXT + "Paris: 21 °C, Zürich: 15 °C.<|im_end|>"
    )
    # OpenAI's string arguments are parsed, as serving stacks do before the template (which
    # would write a string as a JSON string literal); content None counts as "".
    as_sent = weather_chat(content=None, arguments=str)
    ids, labels = tool_example(ours, as_sent, all_assistant_turns=True)
    full = hf_ids(weather_chat())
    assert ids[: len(full) - 1].tolist() == full[:-1]
    assert labelled_text(ours, labels).startswith(CALLS_TEXT + "Paris: 21")
    # A row that ends with the calls trains them as its answer.
    ids, labels = chat(ours, weather_chat(final=False), tools=TOOLS)  # tokenize_chat takes tools
    full = hf_ids(weather_chat(final=False))
    assert ids[: len(full) - 1].tolist() == full[:-1]
    assert labelled_text(ours, labels[: len(full) - 1]) == CALLS_TEXT


def test_tool_rows_the_template_cannot_render_are_skipped(tok, tool_tok):
    user = {"role": "user", "content": "Weather in Paris?"}
    result = {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}
    answer = {"role": "assistant", "content": "21 °C."}

    def calling(*calls, **fields):
        return {"role": "assistant", "content": "", "tool_calls": list(calls), **fields}

    def row(*messages, tools=TOOLS):
        return {"messages": [user, *messages], "tools": tools}

    paris = weather_call("call_1", "Paris")
    kept = [
        row(calling(paris), result, answer),
        row(calling(paris, content=None), result, answer, tools=json.dumps(TOOLS)),  # JSON strings
        row(calling(weather_call("call_1", "Paris", '{"city": "Paris"}')), result, answer),
        row(calling(paris["function"]), {"role": "tool", "content": "21"}, answer),  # bare calls
        row(calling(paris)),  # ends with the call: trained as the answer
        row(calling(), answer, tools=None),  # tool_calls=[]: none
    ]
    bad = {
        "bad_tool_calls": [
            row(calling({**paris, "type": "code_interpreter"}), result, answer),
            row({"role": "assistant", "content": "", "tool_calls": paris}, result, answer),
            row(calling({"type": "function", "function": {"arguments": {}}}), result, answer),
            row(calling({**paris, "id": 1}), result, answer),
            {"messages": [{**user, "tool_calls": [paris]}, answer]},
        ],
        "bad_tool_arguments": [
            row(calling(weather_call("call_1", "Paris", "city=Paris")), result, answer),
            row(calling(weather_call("call_1", "Paris", "[1, 2]")), result, answer),
            row(calling(weather_call("call_1", "Paris", {"x": float("nan")})), result, answer),
            row(calling(weather_call("call_1", "Paris", {"x": {1, 2}})), result, answer),
        ],
        "bad_tools": [row(answer, tools="get_weather"), row(answer, tools=[1, 2])],
        "orphan_tool_message": [
            row(result, answer),  # no call before it
            row(calling(paris), user, result, answer),  # not right after the call
            row(calling(paris), result, result, answer),  # more results than calls
            row(calling(paris), {**result, "tool_call_id": "call_9"}, answer),
        ],
        "special_token_in_content": [
            row(calling(weather_call("call_1", "<|im_end|>")), result, answer),
            row(answer, tools=[{"name": "f<|mask|>"}]),
        ],
        "non_string_content": [row(calling(paris), {**result, "name": 7}, answer)],
        "empty_answer": [row(calling(), tools=None)],  # tool_calls=[] and no content
    }
    rows = kept + [r for rs in bad.values() for r in rs]
    examples, skips = build_examples(rows, tool_tok, "messages", max_length=512, block_size=BS)
    assert skips == {reason: len(rs) for reason, rs in bad.items()} and len(examples) == len(kept)
    for (ids, labels, _), r in zip(examples[:5], kept):
        assert "<tools>" in tool_tok.decode(ids) and "<tool_call>\n{" in tool_tok.decode(ids)
        assert labelled_text(tool_tok, labels).startswith(("<tool_call>", "21 °C."))
    assert examples[0][0].tolist() == examples[2][0].tolist() == examples[1][0].tolist()
    # The built-in Qwen2.5 template has no tool support: it would drop the calls, so rows that
    # use tools are skipped; the Qwen2 release template also drops tool messages.
    tool_rows = kept[:5]
    _, skips = build_examples(tool_rows, tok, "messages", max_length=512, block_size=BS)
    assert skips == {"tools_not_rendered": 5}
    if not (SHARED_DATA / "qwen2-tokenizer" / "vocab.json").exists():
        pytest.skip("qwen2-tokenizer not found")
    qwen2 = load_tokenizer(str(SHARED_DATA / "qwen2-tokenizer"))
    _, skips = build_examples(tool_rows, qwen2, "messages", max_length=512, block_size=BS)
    assert skips == {"tools_not_rendered": 5}


def test_all_assistant_turns_never_trains_an_empty_answer(tok, tool_tok):
    """The row of the issue: a tool-call turn with empty content. Trained on every assistant turn,
    it used to be kept with the call dropped and the model taught to answer it with nothing."""
    messages = weather_chat()
    with pytest.raises(SkipRow, match="tools_not_rendered"):
        tool_example(tok, messages, all_assistant_turns=True)
    ids, labels = tool_example(tool_tok, messages, all_assistant_turns=True)
    assert labelled_text(tool_tok, labels).startswith(CALLS_TEXT + "Paris: 21 °C")
    # An empty earlier assistant turn without calls is no answer to train on either.
    empty = [MULTI[1], {"role": "assistant", "content": ""}, *MULTI[3:5]]
    with pytest.raises(SkipRow, match="empty_answer"):
        chat(tok, empty, all_assistant_turns=True)
    assert labelled_text(tok, chat(tok, empty)[1]).startswith("5 * 4 = 20.")


def test_eval_examples_leave_out_tool_rows(tmp_path):
    plain = {
        "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    }
    rows = [
        {"messages": weather_chat(), "tools": TOOLS},
        {"messages": weather_chat(final=False)},
        plain,
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert eval_examples(str(path), num_examples=3, fmt="messages") == [
        (plain["messages"][:1], "4")
    ]
