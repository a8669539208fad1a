"""Issue 9, items 5 and 10: 10,000 generated malformed rows mixed into GSM8K, read and tokenized
by the public path (`rows.read_rows` + `batches.build_examples`, the real Qwen2.5 tokenizer).

A seeded generator writes each line together with what must become of it: skipped by
`read_rows` (the line holds no row), skipped by `build_examples` (the row cannot be trained on),
each with its reason, or kept with the content its labels must decode to. The test compares the
pipeline's skip counts and kept examples with that record.
"""

import collections
import json
import logging
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest

from mars_jax import config, errors, train_inputs
from mars_jax.batches import build_examples
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.rows import read_rows
from mars_jax.tokenizer import IM_END_ID, load_tokenizer
from tests.helpers import tiny_config

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
GSM8K_TRAIN = SHARED_DATA / "gsm8k" / "train.jsonl"
NUM_MALFORMED = 10_000
BS = 32
MAX_LENGTH = 640  # the longest GSM8K train row renders to 567 tokens: none is cut
LONG = 100_000  # characters of the over-long contents
IM_END = "<|im_end|>"
# Strings the tokenizer turns into control tokens (Qwen2.5's special tokens and MARS's mask).
SPECIAL = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|mask|>", "<|vision_pad|>"]
# Text kept as is: the tokenizer's NFC normalization leaves it unchanged.
WORDS = [
    "apple",
    "Zoë",
    "naïve café",
    "数学",
    "🧮",
    "x = 3 * 4",
    "  spaced  ",
    "a\r\nb",
    "tab\there",
    "line\u2028sep",
    "\ufeffzero-width",
    "<tool_call>",
    "{{ not jinja }}",
    "#### 42",
]


def user(text="What is 2 + 2?"):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def line(obj, ensure_ascii=False) -> bytes:
    return json.dumps(obj, ensure_ascii=ensure_ascii).encode()


def kept(rng, messages_before, end=b"\n", prefix=b""):
    """A row that must be kept: its final assistant content is random text."""
    answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
    row = {"messages": messages_before + [assistant(answer)]}
    return prefix + line(row) + end, ("kept", answer)


# Each generator: rng -> (the line's bytes with its line break, outcome); outcome is
# ("line", reason): read_rows skips it; ("row", reason): build_examples skips it;
# ("kept", content): its labels decode to content + <|im_end|>; ("cut", content): kept, cut
# at MAX_LENGTH inside content; ("blank", None): ignored.
def invalid_json(rng):
    text = rng.choice(
        [
            b'{"messages": [',  # cut off
            b"{'messages': []}",  # single quotes
            b'{"messages": [],}',  # trailing comma
            b"hello",
            b'{"messages": "a\x01b"}',  # a raw control character in a string
            b"[" * 50_000,  # deeper than Python's json reads
        ]
    )
    return text + b"\n", ("line", "invalid_json")


def not_an_object(rng):
    value = rng.choice([b"[1, 2]", b'"text"', b"3", b"null", b"true"])
    return value + b"\n", ("line", "not_an_object")


def invalid_utf8(rng):
    good = line({"messages": [user(), assistant("Caf")]})
    at = good.index(b"Caf") + 3
    # cp1252's é, a byte never in UTF-8, half a €, an overlong "/", an encoded surrogate
    bad = rng.choice([b"\xe9", b"\xff", b"\xe2\x82", b"\xc0\xaf", b"\xed\xa0\x80"])
    return good[:at] + bad + good[at:] + b"\n", ("line", "invalid_utf8")


def nul_byte(rng):
    good = line({"messages": [user(), assistant("x")]})
    return good[:5] + b"\0" + good[5:] + b"\n", ("line", "nul_byte")  # see write_parts


def missing_field(rng):
    obj = rng.choice(
        [
            {},
            {"question": "q", "answer": "a"},  # a GSM8K row read as messages
            {"messages": None},
            {"messages": "hi"},
            {"messages": 3},
            {"messages": {"role": "user", "content": "hi"}},
            {"messages": [user(), {"content": "no role"}]},
            {"messages": [user(), {"role": "assistant"}]},
            {"messages": [user(), "not a message", assistant("x")]},
            {"messages": [None, assistant("x")]},
            {"messages": [[user()], assistant("x")]},
        ]
    )
    return line(obj) + b"\n", ("row", "missing_field")


def none_content(rng):
    messages = rng.choice([[user(None), assistant("x")], [user(), assistant(None)]])
    return line({"messages": messages}) + b"\n", ("row", "none_content")


def non_string_content(rng):
    bad = rng.choice([3, 2.5, True, ["a"], {"text": "a"}])
    messages = rng.choice(
        [
            [user(bad), assistant("x")],
            [user(), assistant(bad)],
            [{"role": bad, "content": "q"}, assistant("x")],
            [{"role": "user", "content": "q", "name": bad}, assistant("x")],
        ]
    )
    return line({"messages": messages}) + b"\n", ("row", "non_string_content")


def empty_answer(rng):
    content = rng.choice(["", " ", "\n\t ", "\r\n"])
    return line({"messages": [user(), assistant(content)]}) + b"\n", ("row", "empty_answer")


def no_assistant_turn(rng):
    messages = rng.choice([[], [user()], [{"role": "system", "content": "s"}, user()]])
    return line({"messages": messages}) + b"\n", ("row", "no_assistant_turn")


def special_token(rng):
    text = f"before {rng.choice(SPECIAL)} after"
    messages = rng.choice(
        [
            [user(text), assistant("x")],
            [user(), assistant(text)],
            [{"role": "system", "content": text}, user(), assistant("x")],
            [{"role": f"user{text}", "content": "q"}, assistant("x")],
        ]
    )
    return line({"messages": messages}) + b"\n", ("row", "special_token_in_content")


def lone_surrogate(rng):
    text = rng.choice(["a\ud800b", "\udfff", "x\udc80"])  # written as JSON escapes
    messages = rng.choice([[user(text), assistant("x")], [user(), assistant(text)]])
    return line({"messages": messages}, ensure_ascii=True) + b"\n", ("row", "lone_surrogate")


def bad_tools(rng):
    tools = rng.choice([5, True, {"a": 1}, "not json"])
    row = {"messages": [user(), assistant("x")], "tools": tools}
    return line(row) + b"\n", ("row", "bad_tools")


def bad_tool_calls(rng):
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    messages = [{"role": "user", "content": "q", "tool_calls": [call]}, assistant("x")]
    return line({"messages": messages}) + b"\n", ("row", "bad_tool_calls")


def orphan_tool_message(rng):
    messages = [user(), {"role": "tool", "content": "42"}, assistant("x")]
    return line({"messages": messages}) + b"\n", ("row", "orphan_tool_message")


def long_prompt(rng):
    row = {"messages": [user("word " * (LONG // 5)), assistant("x")]}
    return line(row) + b"\n", ("row", "prompt_too_long")


def long_answer(rng):
    content = "".join(rng.choice("abc ") for _ in range(LONG))
    return line({"messages": [user(), assistant(content)]}) + b"\n", ("cut", content)


def roles_out_of_order(rng):
    before = rng.choice(
        [
            [],  # the assistant first
            [assistant("first"), user()],
            [user(), user("again")],
            [assistant("a"), assistant("b")],
            [user(), {"role": "narrator", "content": "meanwhile"}],
            [{"role": "", "content": "empty role"}],
        ]
    )
    row, outcome = kept(rng, before)
    if rng.random() < 0.5:  # a user turn after the final assistant turn: not trained on
        obj = json.loads(row)
        obj["messages"].append(user("and then?"))
        row = line(obj) + b"\n"
    return row, outcome


def several_system_turns(rng):
    system = {"role": "system", "content": "Be brief."}
    before = rng.choice(
        [
            [system, dict(system, content="Be kind."), user()],
            [user(), system],
            [system, user(), assistant("4"), system, user()],
            [dict(system, content=""), user("")],  # empty strings
        ]
    )
    return kept(rng, before)


def line_breaks_and_marks(rng):
    # CRLF, a lone CR (old Mac), a byte-order mark at the start of the line (files joined by cat)
    end, prefix = rng.choice([(b"\r\n", b""), (b"\r", b""), (b"\n", b"\xef\xbb\xbf")])
    extra = rng.choice([{}, {"name": None}, {"tool_calls": []}, {"unknown": [1, {"x": None}]}])
    return kept(rng, [dict(user(), **extra)], end=end, prefix=prefix)


def blank(rng):
    # Never a bare "\n": after a line ending in a lone "\r" it would make one "\r\n" break.
    return rng.choice([b" \n", b"   \t\n", b"\r\n"]), ("blank", None)


GENERATORS = {  # generator: relative frequency (a 100,000-character row takes ~0.1 s to tokenize)
    invalid_json: 6,
    not_an_object: 4,
    invalid_utf8: 6,
    nul_byte: 3,
    missing_field: 11,
    none_content: 4,
    non_string_content: 8,
    empty_answer: 4,
    no_assistant_turn: 3,
    special_token: 8,
    lone_surrogate: 4,
    bad_tools: 3,
    bad_tool_calls: 2,
    orphan_tool_message: 2,
    long_prompt: 0.05,
    long_answer: 0.05,
    roles_out_of_order: 12,
    several_system_turns: 8,
    line_breaks_and_marks: 10,
    blank: 4,
}


def gsm8k_line(row):
    messages = [user(row["question"]), assistant(row["answer"])]
    return line({"messages": messages}) + b"\n", ("kept", row["answer"])


def write_parts(tmp_path, seed=0):
    """Two JSON Lines files mixing GSM8K train rows (as messages) with NUM_MALFORMED generated
    lines: the first starts with a UTF-8 byte-order mark, the second has none. In a file with a
    byte-order mark, a NUL byte is no sign of UTF-16 saved without one: it fails as invalid JSON.

    Returns (paths, outcomes): outcomes[i] is the list of (line number, outcome) of paths[i]."""
    rng = random.Random(seed)
    gsm8k = [gsm8k_line(json.loads(r)) for r in GSM8K_TRAIN.read_text().splitlines()]
    generators = rng.choices(list(GENERATORS), weights=list(GENERATORS.values()), k=NUM_MALFORMED)
    mixed = gsm8k[2:] + [g(rng) for g in generators]
    rng.shuffle(mixed)
    half = len(mixed) // 2
    paths, outcomes = [], []
    for i, (bom, lines) in enumerate([(b"\xef\xbb\xbf", mixed[:half]), (b"", mixed[half:])]):
        lines = [gsm8k[i]] + lines  # a plain first line: no accidental byte-order mark
        if bom:
            lines = [
                (text, ("line", "invalid_json") if out == ("line", "nul_byte") else out)
                for text, out in lines
            ]
        path = tmp_path / f"part{i}.jsonl"
        path.write_bytes(bom + b"".join(text for text, _ in lines))
        paths.append(path)
        outcomes.append([(n, out) for n, (_, out) in enumerate(lines, start=1)])
    return paths, outcomes


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    if not GSM8K_TRAIN.exists():
        pytest.skip(f"GSM8K data not found at {GSM8K_TRAIN}")
    return write_parts(tmp_path_factory.mktemp("malformed"))


def expected_lines(outcomes):
    """(number of non-blank lines, numbers of the lines read_rows skips) of one file."""
    nonblank = [(n, out) for n, out in outcomes if out[0] != "blank"]
    return len(nonblank), [n for n, out in nonblank if out[0] == "line"]


def test_malformed_rows_are_skipped_by_reason_and_kept_rows_label_their_answer(tok, mixture):
    paths, outcomes = mixture
    skips = collections.Counter()
    rows = []
    for path, out in zip(paths, outcomes):
        num_lines, bad = expected_lines(out)
        rows += read_rows(path, max_bad_fraction=len(bad) / num_lines, skips=skips)
    examples, row_skips = build_examples(
        rows,
        tok,
        "messages",
        max_length=MAX_LENGTH,
        block_size=BS,
        source_name="mixture",
        truncate=False,
    )
    skips.update(row_skips)

    flat = [out for part in outcomes for _, out in part]
    assert collections.Counter(kind for kind, _ in flat)["blank"] > 0
    expected = collections.Counter(reason for kind, reason in flat if kind in ("line", "row"))
    expected["too_long"] = sum(kind == "cut" for kind, _ in flat)  # truncate=False skips them
    assert skips == expected, (skips - expected, expected - skips)
    assert set(expected) == {  # every reason the generators make occurs
        "invalid_json",
        "not_an_object",
        "invalid_utf8",
        "nul_byte",
        "missing_field",
        "none_content",
        "non_string_content",
        "empty_answer",
        "no_assistant_turn",
        "special_token_in_content",
        "lone_surrogate",
        "bad_tools",
        "bad_tool_calls",
        "orphan_tool_message",
        "prompt_too_long",
        "too_long",
    }
    answers = [content for kind, content in flat if kind == "kept"]
    assert len(examples) == len(answers)
    for (ids, labels, _), content in zip(examples, answers):
        mask = labels != IGNORE_INDEX
        np.testing.assert_array_equal(labels[mask], ids[mask])
        first = int(np.argmax(mask))
        assert mask[first:].all(), "the labels are one run up to the end"
        text = tok.decode(ids[mask], skip_special_tokens=False)
        assert text.startswith(content + IM_END), (content, text)
        pads = text[len(content + IM_END) :]
        num_pads = pads.count(IM_END)
        assert pads == IM_END * num_pads
        # Labelled <|im_end|> padding up to the next multiple of the block size, no further.
        assert len(ids) % BS == 0 and num_pads == -(len(ids) - num_pads) % BS
        assert (ids[len(ids) - num_pads :] == IM_END_ID).all()


def test_long_answers_are_cut_by_default(tok):
    """truncate=True (the reference's behaviour, the default): an answer past max_length keeps
    its first tokens as labels, a prefix of the answer with no <|im_end|>."""
    rng = random.Random(5)
    contents = [long_answer(rng)[1][1] for _ in range(3)]
    rows = [{"messages": [user(), assistant(c)]} for c in contents]
    examples, skips = build_examples(
        rows, tok, "messages", max_length=MAX_LENGTH, block_size=BS, source_name="long"
    )
    assert not skips and len(examples) == len(contents)
    for (ids, labels, _), content in zip(examples, contents):
        mask = labels != IGNORE_INDEX
        text = tok.decode(ids[mask], skip_special_tokens=False)
        assert len(ids) == MAX_LENGTH and text == content[: len(text)] and len(text) > 0
        assert ids[mask].tolist() == tok.encode(content)[: mask.sum()]


def test_bad_lines_stop_the_read_only_past_the_fraction(mixture, caplog):
    paths, outcomes = mixture
    path = paths[1]
    num_lines, bad = expected_lines(outcomes[1])
    fraction = len(bad) / num_lines
    assert bad and bad[0] > 1
    caplog.set_level(logging.WARNING)
    rows = read_rows(path, max_bad_fraction=fraction)  # at the fraction: read
    assert len(rows) == num_lines - len(bad)
    first = ", ".join(str(n) for n in bad[:5])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"the first at lines {first}" in warnings[0]
    assert all(f"{path}:{n}: " in warnings[0] for n in bad[:5])
    assert f"{path}:{bad[5]}:" not in warnings[0]
    below = math.nextafter(fraction, 0)
    with pytest.raises(ValueError) as e:
        read_rows(path, max_bad_fraction=below)
    message = str(e.value)
    assert message.startswith(f"{path}:{bad[0]}: ") and "\n" not in message
    assert f"{len(bad)} of {num_lines} non-blank lines ({fraction:.2%})" in message
    assert f"the first at lines {first}" in message and f"max_bad_fraction={below}" in message
    with pytest.raises(ValueError, match="this file must be valid throughout"):  # default 0
        read_rows(path)


def test_config_key_reaches_training_data(tmp_path, tok):
    rows = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(3)]
    path = tmp_path / "train.jsonl"
    path.write_bytes(line(rows[0]) + b"\n{oops\n" + line(rows[1]) + b"\n" + line(rows[2]) + b"\n")
    cfg = tiny_config()
    cfg.data.update(source="gsm8k", train_path=str(path), max_bad_fraction=0.25)
    examples = train_inputs.load_train_examples(cfg, tok)
    assert [tok.decode(ids[labels != IGNORE_INDEX]) for ids, labels, _ in examples] == [
        "a0",
        "a1",
        "a2",
    ]
    cfg.data.max_bad_fraction = 0.2
    match = rf"^{re.escape(str(path))}:2: invalid JSON: .*1 of 4 non-blank"
    with pytest.raises(ValueError, match=match):
        train_inputs.load_train_examples(cfg, tok)
    # data.truncate: a row longer than max_length is cut (True) or skipped (False).
    path.write_bytes(line(rows[0]) + b"\n" + line({"question": "q", "answer": "word " * 500}))
    assert len(train_inputs.load_train_examples(cfg, tok)) == 2
    cfg.data.truncate = False
    assert len(train_inputs.load_train_examples(cfg, tok)) == 1


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_max_bad_fraction_setting(value):
    cfg = tiny_config()
    cfg.data.max_bad_fraction = value
    with pytest.raises(errors.SettingError, match=r"^data\.max_bad_fraction=.*\[0, 1\]"):
        config.validate(cfg, training=True)
