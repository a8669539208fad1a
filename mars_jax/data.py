"""SFT data for MARS: rows -> tokenized chat examples -> index-addressable grain batches.

The tokenization follows the MARS reference's SFT data path (arXiv 2604.07023): a conversation
is rendered with the checkpoint's chat template; the tokens of the final assistant turn (its
content and closing ``<|im_end|>``) are the labels; the sequence ends there and is padded with
labelled ``<|im_end|>`` up to a multiple of the block size, so the model learns to fill the
rest of a block with EOS.
"""

import codecs
import collections
import json
import re
from pathlib import Path
from typing import NamedTuple, Sequence

import grain
import jinja2
import numpy as np
import pyarrow.parquet as pq
from absl import logging

from mars_jax.errors import InputError
from mars_jax.synthetic import arithmetic_problems
from mars_jax.tokenizer import CONTROL_TOKENS, ENDOFTEXT_ID, MASK_TOKEN

# Strings that the tokenizer turns into control tokens: in content they would end a turn early
# or put <|mask|> into the clean stream, so such rows are skipped.
_SPECIAL_STRINGS = tuple(text for _, text, special in CONTROL_TOKENS if special) + (MASK_TOKEN,)
_SURROGATE = re.compile("[\ud800-\udfff]")

IGNORE_INDEX = -100  # label of a token that is not trained on
SYNTHETIC = "synthetic"  # source name of the built-in arithmetic problems (see `load_rows`)


class Example(NamedTuple):
    """One tokenized conversation: input_ids and labels int32[n], and ``row``, the 0-based index
    of its source row among the rows it was built from (`build_examples`; logged with a batch
    whose loss is not finite)."""

    input_ids: np.ndarray
    labels: np.ndarray
    row: int


class SkipRow(Exception):
    """A row that cannot be trained on; `reason` (str) is the key it is counted under."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # as Python's universal newlines; "\u2028" etc. are text
_BYTE_LINE_BREAK = re.compile(rb"\r\n|\r|\n")  # the same in UTF-8 bytes
_JSON_SPACE = re.compile(r"[ \t\r\n]*")
# Byte-order marks and the codec of the text after them; the UTF-32 LE mark begins with the
# UTF-16 LE one, so it is tried first.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le", "UTF-32 LE"),
    (codecs.BOM_UTF32_BE, "utf-32-be", "UTF-32 BE"),
    (codecs.BOM_UTF8, "utf-8", "UTF-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le", "UTF-16 LE"),
    (codecs.BOM_UTF16_BE, "utf-16-be", "UTF-16 BE"),
)


def _line_and_column(text: str) -> tuple[int, int]:
    """1-based (line, column) of the character just after `text`."""
    breaks = list(_LINE_BREAK.finditer(text))
    return len(breaks) + 1, len(text) - (breaks[-1].end() if breaks else 0) + 1


def _byte_order_mark(raw: bytes) -> tuple[bytes, str, str]:
    """(mark, codec, name) of the byte-order mark `raw` starts with; (b"", "utf-8", "UTF-8")
    without one."""
    return next((entry for entry in _BOMS if raw.startswith(entry[0])), (b"", "utf-8", "UTF-8"))


def _decode(path: Path, raw: bytes) -> str:
    """The text of a JSON or JSONL file: UTF-8, or UTF-8/16/32 after a byte-order mark (dropped).

    Raises:
      ValueError: bytes not valid in the file's encoding, or a NUL byte in a file without a
        byte-order mark (UTF-16/32 saved without one); the message names the file, line, column
        and byte offset.
    """
    bom, codec, name = _byte_order_mark(raw)
    body = raw[len(bom) :]
    if not bom and (offset := body.find(b"\0")) >= 0:
        line, column = _line_and_column(body[:offset].decode("utf-8", errors="replace"))
        raise InputError(f"{path}:{line}: {_nul_message(offset, column)}")
    try:
        return body.decode(codec)
    except UnicodeDecodeError as e:
        line, column = _line_and_column(body[: e.start].decode(codec))
        raise InputError(
            f"{path}:{line}: {_bad_bytes_message(name, len(bom) + e.start, column, e.reason, bom)}"
        ) from None


def _nul_message(offset: int, column: int) -> str:
    return (
        f"NUL byte at byte offset {offset} (column {column}); UTF-16 or UTF-32 without a "
        "byte-order mark? Save the file as UTF-8"
    )


def _bad_bytes_message(name: str, offset: int, column: int, reason: str, bom: bytes) -> str:
    hint = "; is the file in another encoding, such as cp1252? Save it as UTF-8" * (not bom)
    return f"invalid {name} at byte offset {offset} (column {column}): {reason}{hint}"


class _BadLine(Exception):
    """A JSON Lines line that holds no row: `reason` (str) is the key it is counted under, the
    message says why, without the file and line."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _line_object(line: bytes, offset: int, bom: bytes, hint: str) -> dict | None:
    """The JSON object on one line (UTF-8 bytes, without its line break, starting at byte
    `offset` of the file); None for a blank or whitespace-only line. A byte-order mark at the
    start of the line (files joined with `cat`) is ignored.

    Raises:
      _BadLine: with reason invalid_utf8 (bytes that are not UTF-8), nul_byte (a NUL byte in a
        file without a byte-order mark: UTF-16/32 saved without one), invalid_json (not JSON,
        or nested deeper than Python's json reads) or not_an_object (a JSON value other than
        an object); `hint` is appended to the last two messages.
    """
    if not bom and (at := line.find(b"\0")) >= 0:
        column = len(line[:at].decode("utf-8", errors="replace")) + 1
        raise _BadLine("nul_byte", _nul_message(offset + at, column))
    try:
        text = line.decode("utf-8").lstrip("\ufeff")
    except UnicodeDecodeError as e:
        column = len(line[: e.start].decode("utf-8")) + 1
        message = _bad_bytes_message("UTF-8", offset + e.start, column, e.reason, bom)
        raise _BadLine("invalid_utf8", message) from None
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise _BadLine("invalid_json", f"invalid JSON: {e}{hint}") from None
    if not isinstance(value, dict):
        raise _BadLine("not_an_object", f"expected a JSON object, got {type(value).__name__}{hint}")
    return value


_ARRAY_HINT = (
    "; the file looks like one JSON array, not JSON Lines (one object per line): "
    "name it .json to read it as an array"
)
_SHOWN_BAD_LINES = 5  # bad lines that a warning or error names by file:line


def _byte_lines(body: bytes):
    """Yields (byte offset, bytes) of each line of `body`, without its line break."""
    start = 0
    for brk in _BYTE_LINE_BREAK.finditer(body):
        yield start, body[start : brk.start()]
        start = brk.end()
    yield start, body[start:]


def _json_lines(
    path: Path, body: bytes, bom: bytes, max_bad_fraction: float
) -> tuple[list[dict], collections.Counter]:
    """The rows of JSON Lines `body` (UTF-8 bytes after the file's byte-order mark `bom`): one
    object per line, blank lines ignored, and a Counter of the lines that hold none (see
    `_line_object`) by reason. Such lines are skipped and logged (a WARNING naming the first
    ones by file:line) up to `max_bad_fraction` of the non-blank lines.

    Raises:
      ValueError: more than `max_bad_fraction` of the non-blank lines hold no object; the
        message starts with the first bad line's `file:line: problem`, then gives the count,
        the fraction and the line numbers of the first bad lines.
    """
    rows, reasons, shown = [], collections.Counter(), []
    for line_no, (start, line) in enumerate(_byte_lines(body), start=1):
        hint = ""
        if not rows and not reasons:  # the first non-blank line
            if line.lstrip(codecs.BOM_UTF8 + b" \t").startswith(b"["):
                hint = _ARRAY_HINT
            elif path.suffix.lower() == ".json":  # e.g. one pretty-printed object
                hint = "; a .json file must hold a JSON array of objects, or JSON Lines"
        try:
            row = _line_object(line, len(bom) + start, bom, hint)
        except _BadLine as e:
            reasons[e.reason] += 1
            if len(shown) < _SHOWN_BAD_LINES:
                shown.append((line_no, f"{path}:{line_no}: {e}"))
            continue
        if row is not None:
            rows.append(row)
    if reasons:
        num_bad = reasons.total()
        num_lines = len(rows) + num_bad
        summary = (
            f"{num_bad} of {num_lines} non-blank lines ({num_bad / num_lines:.2%}) hold no JSON "
            f"object ({dict(reasons)}); the first at lines {', '.join(str(n) for n, _ in shown)}"
        )
        if num_bad / num_lines > max_bad_fraction:
            limit = (
                f"more than max_bad_fraction={max_bad_fraction}" if max_bad_fraction
                else "this file must be valid throughout (data.max_bad_fraction applies to "
                "training files only)"
            )
            raise InputError(f"{shown[0][1]}; {summary}: {limit}")
        logging.warning("%s: %s, skipped: %s", path, summary, "; ".join(m for _, m in shown))
    return rows, reasons


def _json_array(path: Path, text: str) -> list[dict]:
    """A JSON array of objects; an error names the line where the offending element starts."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:  # json counts only "\n" as a line break
        raise InputError(f"{path}:{_line_and_column(text[: e.pos])[0]}: invalid JSON: {e}") from e
    for index, row in enumerate(rows):
        if not isinstance(row, dict):  # find the line of element `index` of the (valid) array
            decoder, pos = json.JSONDecoder(), text.index("[") + 1
            for _ in range(index + 1):
                start = _JSON_SPACE.match(text, pos).end()
                _, pos = decoder.raw_decode(text, start)
                pos = _JSON_SPACE.match(text, pos).end() + 1  # past the ","
            raise InputError(
                f"{path}:{_line_and_column(text[:start])[0]}: expected a JSON object, got "
                f"{type(row).__name__} (array element {index})"
            )
    return rows


def read_rows(
    path: str | Path, *, max_bad_fraction: float = 0.0, skips: collections.Counter | None = None
) -> list[dict]:
    """Reads the rows of a `.jsonl`, `.json` or `.parquet` file (the extension in any case).

    A `.jsonl` file holds one JSON object per line; a `.json` file is either a JSON array of
    objects (when its first non-blank character is "[") or JSON Lines. Text is read as files are
    saved by editors, spreadsheets and Windows tools: UTF-8, with or without a byte-order mark,
    or UTF-16/UTF-32 with one; lines end in "\\n", "\\r\\n" or a lone "\\r" (old Mac), the last
    one may lack it; blank and whitespace-only lines are ignored, and so is a byte-order mark at
    the start of a line (files joined with `cat`).

    In JSON Lines, a line that holds no row is skipped and counted by reason: invalid_utf8
    (bytes that are not UTF-8), nul_byte (a NUL byte in a file without a byte-order mark),
    invalid_json, not_an_object (a JSON value other than an object). A WARNING names the first
    five by file:line. Only such lines count here; rows that parse but cannot be trained on are
    counted by `build_examples`. A JSON array, or a UTF-16/32 file with invalid bytes, is read
    whole or not at all.

    Args:
      path: the file.
      max_bad_fraction: the largest fraction of the non-blank lines of a JSON Lines file that
        may be skipped (0: none, the default; 1: any number).
      skips: a Counter that the skipped lines are added to by reason (None: not reported).
    Returns:
      The rows, as dicts, in file order.
    Raises:
      ValueError: the message names the file and the 1-based line: more than
        `max_bad_fraction` of the lines hold no row (the message starts with the first one's
        problem and lists the first line numbers and the fraction); an array element is not
        valid JSON or not an object; bytes that are not valid UTF-16/32 after its byte-order
        mark, or not UTF-8 in a JSON array, with the byte offset; a NUL byte in a JSON array
        without a byte-order mark (UTF-16 saved without one); or the extension is none of the
        three.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if suffix not in (".jsonl", ".json"):
        raise InputError(f"{path}: expected a .jsonl, .json or .parquet file")
    raw = path.read_bytes()
    bom, codec, _ = _byte_order_mark(raw)
    body = raw[len(bom) :]
    if codec != "utf-8" or (suffix == ".json" and body.lstrip(b" \t\r\n").startswith(b"[")):
        text = _decode(path, raw)
        if suffix == ".json" and text.lstrip(" \t\r\n").startswith("["):
            return _json_array(path, text)
        body = text.encode()  # UTF-16/32 JSON Lines, decoded whole: now valid UTF-8
    rows, reasons = _json_lines(path, body, bom, max_bad_fraction)
    if skips is not None:
        skips.update(reasons)
    return rows


def load_rows(source: str, *, num_rows: int | None = None, seed: int = 0) -> list[dict]:
    """Rows of `source`: a `.jsonl`, `.json` or `.parquet` path (read by `read_rows`; its first
    `num_rows` rows, all if None), or `"synthetic"` for `num_rows` problems of
    `synthetic.arithmetic_problems(num_rows, seed)` (format `gsm8k`)."""
    if source == SYNTHETIC:
        if num_rows is None:
            raise InputError("the synthetic source needs num_rows")
        return arithmetic_problems(num_rows, seed)
    return read_rows(source)[:num_rows]


def rows_to_messages(row: dict, fmt: str) -> list[dict]:
    """Maps a row to a list of messages (`{"role", "content"}` dicts, see `tokenize_chat` for the
    tool-use fields that pass through to the chat template).

    `fmt="messages"`: the row's `messages` list as is. `fmt="gsm8k"`: `{question, answer}` ->
    a user turn with the question and an assistant turn with the answer.

    Raises:
      SkipRow("missing_field"): the row lacks the fields of its format.
      ValueError: unknown `fmt`.
    """
    if fmt == "messages":
        if not isinstance(row.get("messages"), list):
            raise SkipRow("missing_field")
        return row["messages"]
    if fmt == "gsm8k":
        if "question" not in row or "answer" not in row:
            raise SkipRow("missing_field")
        return [
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": row["answer"]},
        ]
    raise InputError(f"unknown row format {fmt!r}; expected 'messages' or 'gsm8k'")


def row_tools(row: dict, fmt: str):
    """The row's `tools` (the functions its conversation may call, for the chat template's `tools`)
    with `fmt="messages"`, as stored (checked by `tokenize_chat`); None when absent or for gsm8k."""
    return row.get("tools") if fmt == "messages" else None


def _json_text(value, reason: str) -> str:
    """`value` as the JSON text a template's `tojson` writes; SkipRow(reason) if it is no JSON
    value (NaN, bytes, a set, ...)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        raise SkipRow(reason) from None


def _check_text(text: str) -> None:
    """SkipRow("special_token_in_content") for a control-token string in `text`;
    SkipRow("lone_surrogate") for an unpaired UTF-16 surrogate (a JSON escape such as "\\ud800"
    without its pair), which is no Unicode text and cannot be tokenized."""
    if any(t in text for t in _SPECIAL_STRINGS):
        raise SkipRow("special_token_in_content")
    if _SURROGATE.search(text):
        raise SkipRow("lone_surrogate")


def _without_none(d: dict) -> dict:
    """`d` less its None values (absent fields, as OpenAI's API and parquet schemas write them)."""
    return {k: v for k, v in d.items() if v is not None}


def _checked_tool_call(call) -> dict:
    """A copy of one entry of an assistant message's `tool_calls`: OpenAI's `{"type": "function",
    "function": {"name": str, "arguments": ...}}` (an `id` str optional) or the bare
    `{"name", "arguments"}`, with None fields dropped and `arguments` given as a JSON object or as
    a string holding one (OpenAI's wire format) turned into that object (a dict), as the serving
    stacks hand it to a chat template; a template renders a string as a JSON string literal."""
    if not isinstance(call, dict):
        raise SkipRow("bad_tool_calls")
    call = _without_none(call)
    function = call.get("function", call)
    if (
        call.get("type", "function") != "function"
        or not isinstance(call.get("id", ""), str)
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
        or not function["name"]
    ):
        raise SkipRow("bad_tool_calls")
    function = _without_none(function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise SkipRow("bad_tool_arguments") from None
    if not isinstance(arguments, dict):
        raise SkipRow("bad_tool_arguments")
    _json_text(arguments, "bad_tool_arguments")
    function["arguments"] = arguments
    return {**call, "function": function} if "function" in call else function


def _checked_tools(tools) -> list[dict] | None:
    """The row-level `tools`: a list of JSON objects (or a string holding one), None if absent or
    empty. Raises SkipRow("bad_tools") or SkipRow("special_token_in_content")."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise SkipRow("bad_tools") from None
    if not tools:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise SkipRow("bad_tools")
    _check_text(_json_text(tools, "bad_tools"))
    return tools


def _checked_message(m) -> dict:
    """A copy of one message with role, content and the tool-use fields that are set (see
    `tokenize_chat`); an assistant message with tool calls may lack content (None -> "")."""
    if not isinstance(m, dict) or "role" not in m:
        raise SkipRow("missing_field")
    calls = m.get("tool_calls") or None  # [] and None: no calls
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise SkipRow("bad_tool_calls")
        calls = [_checked_tool_call(c) for c in calls]
        _check_text(_json_text(calls, "bad_tool_calls"))
    if "content" not in m and calls is None:
        raise SkipRow("missing_field")
    content = m.get("content")
    if content is None:
        if calls is None:
            raise SkipRow("none_content")
        content = ""
    texts = {"content": content, **_without_none({f: m.get(f) for f in ("name", "tool_call_id")})}
    if not isinstance(m["role"], str) or not all(isinstance(t, str) for t in texts.values()):
        raise SkipRow("non_string_content")
    for text in (m["role"], *texts.values()):
        _check_text(text)
    return {"role": m["role"], **texts, **({"tool_calls": calls} if calls else {})}


def _checked_messages(messages: list) -> tuple[list[dict], int]:
    """Validates messages; returns copies of them (see `_checked_message`) and the index of the
    final assistant turn. Raises SkipRow with the reason of the first problem found."""
    clean = [_checked_message(m) for m in messages]
    unanswered = []  # ids (None: no id) of the calls that the following tool messages answer
    for m in clean:
        if m["role"] != "tool":
            unanswered = [call.get("id") for call in m.get("tool_calls", [])]
            continue
        if not unanswered:  # no call before it, or more answers than calls
            raise SkipRow("orphan_tool_message")
        answers = m.get("tool_call_id")
        if answers is not None and any(unanswered):
            if answers not in unanswered:
                raise SkipRow("orphan_tool_message")
            unanswered.remove(answers)
        else:
            unanswered.pop(0)
    turns = [i for i, m in enumerate(clean) if m["role"] == "assistant"]
    if not turns:
        raise SkipRow("no_assistant_turn")
    if not clean[turns[-1]]["content"].strip() and "tool_calls" not in clean[turns[-1]]:
        raise SkipRow("empty_answer")
    return clean, turns[-1]


def _check_tool_use_rendered(tokenizer, messages: list[dict], tools, full: str) -> None:
    """SkipRow("tools_not_rendered") when the chat template renders `messages` (and `tools`) as
    `full` also without the tools, without one message's tool calls, or without one tool message:
    a template without tool support, which would train on a silently changed conversation."""
    probes = [(messages, None)] if tools else []
    for i, m in enumerate(messages):
        if "tool_calls" in m:
            without = {k: v for k, v in m.items() if k != "tool_calls"}
            probes.append((messages[:i] + [without] + messages[i + 1 :], tools))
        elif m["role"] == "tool":
            probes.append((messages[:i] + messages[i + 1 :], tools))
    for probe_messages, probe_tools in probes:
        try:
            same = tokenizer.render_chat(probe_messages, tools=probe_tools) == full
        except jinja2.TemplateError:  # the template reads what the probe took away
            same = False
        if same:
            raise SkipRow("tools_not_rendered")


def _chat_segments(
    tokenizer, messages: list, all_assistant_turns: bool, tools=None
) -> list[tuple[str, bool]]:
    """Splits the rendered conversation into `(text, labelled)` pieces that end at the final
    assistant turn's `<|im_end|>`. An assistant turn at message k is located by rendering
    `messages[:k]` with the generation prompt, which must be a prefix of the full rendering; its
    labelled piece runs from there through the next `<|im_end|>`, and must hold more than
    whitespace (else SkipRow("empty_answer"))."""
    messages, last = _checked_messages(messages)
    tools = _checked_tools(tools)
    messages = messages[: last + 1]
    full = tokenizer.render_chat(messages, tools=tools)
    _check_tool_use_rendered(tokenizer, messages, tools, full)
    eos = tokenizer.decode([tokenizer.eos_id], skip_special_tokens=False)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    segments, pos = [], 0
    for k in turns if all_assistant_turns else [last]:
        prompt = tokenizer.render_chat(messages[:k], add_generation_prompt=True, tools=tools)
        start = len(prompt)
        end = full.find(eos, start)
        if start < pos or not full.startswith(prompt) or end < 0:
            raise InputError(
                f"chat template renders assistant turn {k} in an unsupported way: "
                "the generation prompt is not a prefix of the rendered conversation"
            )
        if not full[start:end].strip():  # e.g. an empty earlier turn with all_assistant_turns
            raise SkipRow("empty_answer")
        segments += [(full[pos:start], False), (full[start : end + len(eos)], True)]
        pos = end + len(eos)
    return segments


def _assemble(
    pieces: list[list[int]],
    labelled: list[bool],
    *,
    max_length: int,
    block_size: int,
    bos_id: int,
    eos_id: int,
    truncate: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates tokenized pieces into (input_ids, labels): BOS in front when the first token
    is labelled, truncation to max_length (or, with ``truncate`` False, SkipRow("too_long") when
    that would drop a labelled token), labelled EOS padding to a multiple of block_size."""
    ids = np.concatenate([np.asarray(p, np.int32) for p in pieces])
    mask = np.concatenate([np.full(len(p), flag) for p, flag in zip(pieces, labelled)])
    if mask[0]:
        ids, mask = (
            np.concatenate([[bos_id], ids]).astype(np.int32),
            np.concatenate([[False], mask]),
        )
    if not mask[:max_length].any():
        raise SkipRow("prompt_too_long")
    if not truncate and mask[max_length:].any():
        raise SkipRow("too_long")
    ids, mask = ids[:max_length], mask[:max_length]
    pad = np.full(-len(ids) % block_size, eos_id, np.int32)
    return np.concatenate([ids, pad]), np.concatenate([np.where(mask, ids, IGNORE_INDEX), pad])


def _check_lengths(max_length: int, block_size: int) -> None:
    if block_size <= 0 or max_length <= 0 or max_length % block_size:
        raise InputError(
            f"max_length ({max_length}) must be a positive multiple of block_size ({block_size})"
        )


def tokenize_chat(
    tokenizer,
    messages: list[dict],
    *,
    max_length: int,
    block_size: int,
    all_assistant_turns: bool = False,
    tools=None,
    truncate: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenizes one conversation for MARS SFT, as the MARS reference's SFT data path does.

    The prompt before the final assistant turn is tokenized exactly as
    `tokenizer.encode(tokenizer.render_chat(messages[:k], add_generation_prompt=True, tools))`, so
    training sees the prompt tokens decoding sees. Labels equal `input_ids` (unshifted) on what
    the template renders for the final assistant turn after its generation prompt, through its
    closing `<|im_end|>` (every assistant turn's with `all_assistant_turns`), and are
    IGNORE_INDEX elsewhere. The sequence ends at the final labelled `<|im_end|>`; rows longer
    than `max_length` are cut to it, keeping surviving labels (the reference's behaviour), or,
    with `truncate` False, skipped as too_long when the cut would drop a labelled token; then
    labelled `<|im_end|>` pads it to a multiple of `block_size`. A BOS is prepended only if the first token would be labelled.

    Tool use (OpenAI's chat format) reaches the template as `transformers`'
    `apply_chat_template(messages, tools=tools)` passes it: a message's `tool_calls` (on
    assistant messages: a list of `{"type": "function", "function": {"name": str, "arguments":
    dict}}`, `"id"` optional; `arguments` may also be a string holding a JSON object, which is
    parsed, as serving stacks do), `name` and `tool_call_id` (str); None values count as absent,
    other message fields are dropped; `tools` is the row's list of function schemas (or a string
    holding one). An assistant turn with tool calls may have empty or None content; trained, it is
    labelled with the template's rendering of its calls (e.g. Qwen2.5's `<tool_call>` blocks).

    Returns:
      (input_ids, labels), both int32[n] with n a multiple of block_size, n <= max_length.
    Raises:
      ValueError: max_length is not a positive multiple of block_size, or the chat template does
        not render assistant turns after their generation prompt.
      SkipRow: with its reason:
        prompt_too_long; too_long (only with `truncate` False); missing_field; none_content; non_string_content (a role, content, name
        or tool_call_id that is not a str); special_token_in_content (a control-token string
        such as "<|im_end|>" or "<|mask|>" in a role, content, tool call or the tools);
        lone_surrogate (one of those strings holds an unpaired UTF-16 surrogate);
        no_assistant_turn; empty_answer (the final assistant turn has neither content nor tool
        calls, or a trained turn renders as whitespace only); bad_tool_calls (`tool_calls` not a
        list of function calls, or on a message that is not the assistant's); bad_tool_arguments
        (arguments neither a JSON object nor a string holding one, or not JSON-serialisable);
        bad_tools (`tools` not a list of JSON objects); orphan_tool_message (a `tool` message
        that does not directly follow an assistant's calls, answers more calls than were made,
        or names a `tool_call_id` none of them has); tools_not_rendered (the template renders the
        row the same without its tools, some message's tool calls or some tool message: it has
        no tool support, e.g. the built-in Qwen2.5 template or the Qwen2 release's).
    """
    _check_lengths(max_length, block_size)
    texts, labelled = zip(*_chat_segments(tokenizer, messages, all_assistant_turns, tools))
    return _assemble(
        tokenizer.encode_batch(list(texts)),
        list(labelled),
        max_length=max_length,
        block_size=block_size,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        truncate=truncate,
    )


def build_examples(
    rows,
    tokenizer,
    fmt: str,
    *,
    max_length: int,
    block_size: int,
    all_assistant_turns: bool = False,
    max_label_tokens: int | None = None,
    source_name: str = "",
    truncate: bool = True,
) -> tuple[list[Example], collections.Counter]:
    """Tokenizes rows (see `rows_to_messages`, `row_tools` and `tokenize_chat`) with one batched
    encode.

    Skipped rows are counted by reason (those of `tokenize_chat`, plus template_error: the chat
    template raised while rendering the row) and logged with `source_name`, as is the number of
    kept rows cut to `max_length` (`truncate`: see `tokenize_chat`).

    Returns:
      (examples, skips): a list of `Example` (input_ids int32[n], labels int32[n], and the
      0-based index of its row in `rows`) and a Counter of skip reasons.
    Raises:
      ValueError: as `tokenize_chat`; or a kept row has more than `max_label_tokens` labelled
        tokens (EOS padding included; the loss computes logits at no more positions per row,
        so such a row cannot be trained on faithfully). The message names source, row and count.
    """
    _check_lengths(max_length, block_size)
    skips = collections.Counter()
    kept = []  # (row index, segments)
    for index, row in enumerate(rows):
        try:
            messages, tools = rows_to_messages(row, fmt), row_tools(row, fmt)
            kept.append((index, _chat_segments(tokenizer, messages, all_assistant_turns, tools)))
        except SkipRow as e:
            skips[e.reason] += 1
        except jinja2.TemplateError:  # e.g. a template that needs a turn before the assistant's
            skips["template_error"] += 1
    encoded = iter(tokenizer.encode_batch([text for _, segs in kept for text, _ in segs]))
    examples, truncated = [], 0
    for index, segments in kept:
        pieces = [next(encoded) for _ in segments]
        try:
            example = _assemble(
                pieces,
                [flag for _, flag in segments],
                max_length=max_length,
                block_size=block_size,
                bos_id=tokenizer.bos_id,
                eos_id=tokenizer.eos_id,
                truncate=truncate,
            )
        except SkipRow as e:
            skips[e.reason] += 1
            continue
        truncated += sum(map(len, pieces)) + bool(segments[0][1]) > max_length  # + BOS
        num_labels = int((example[1] != IGNORE_INDEX).sum())
        if max_label_tokens is not None and num_labels > max_label_tokens:
            raise InputError(
                f"{source_name}: row {index} has {num_labels} labelled tokens, more than "
                f"max_label_tokens={max_label_tokens}"
            )
        examples.append(Example(*example, row=index))
    logging.info(
        "data %s: kept %d of %d rows%s; skipped: %s",
        source_name,
        len(examples),
        len(examples) + sum(skips.values()),
        f" ({truncated} cut to max_length={max_length})" if truncated else "",
        dict(skips) or "none",
    )
    return examples, skips


def _collate(batch: list[Example], *, batch_size: int, max_length: int, pad_id: int) -> dict:
    """Stacks examples into int32[batch_size, max_length] arrays; missing rows and positions are
    padded with `pad_id` / IGNORE_INDEX. `row_ids` int32[batch_size]: each example's source row,
    -1 for a padding row."""
    input_ids = np.full((batch_size, max_length), pad_id, np.int32)
    labels = np.full((batch_size, max_length), IGNORE_INDEX, np.int32)
    row_ids = np.full(batch_size, -1, np.int32)
    for i, (ids, lab, row) in enumerate(batch):
        input_ids[i, : len(ids)], labels[i, : len(lab)], row_ids[i] = ids, lab, row
    return {"input_ids": input_ids, "labels": labels, "row_ids": row_ids}


def batched_dataset(
    examples: list[Example],
    *,
    batch_size: int,
    max_length: int,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    pad_id: int = ENDOFTEXT_ID,
    rows: Sequence[int] | None = None,
) -> grain.MapDataset:
    """A grain MapDataset whose element i is the i-th training batch, or this process's rows
    of it.

    Each element is `{"input_ids": int32[batch_size, max_length], "labels": int32[batch_size,
    max_length], "row_ids": int32[batch_size]}` padded with `pad_id` (`<|endoftext|>`),
    IGNORE_INDEX and -1 (`row_ids`: each example's `Example.row`; host-side only, not a model
    input). Examples are shuffled
    per epoch (grain reseeds the shuffle for every repetition: a different permutation each
    epoch, deterministic in `seed`), batched within an epoch (`drop_remainder` drops an epoch's
    last partial batch; otherwise it is filled with padding rows), and repeated `num_epochs`
    times (forever if None). Being index-addressable, training resumes at step s by reading
    element s.

    `rows` (ascending indices into the batch, e.g. `distributed.process_rows`) makes element i
    hold only those rows of the i-th batch, `[len(rows), max_length]`, in that order; None
    means all. In a multi-process run every process shuffles and batches the same examples
    identically and collates only its rows, so the processes' parts form exactly the batch that
    one process would read. A row past the end of a partial last batch is a padding row.

    Raises:
      ValueError: no examples, an example longer than max_length, fewer examples than
        batch_size with drop_remainder, or rows not ascending within [0, batch_size).
    """
    if not examples or (drop_remainder and len(examples) < batch_size):
        raise InputError(f"{len(examples)} examples cannot fill a batch of {batch_size}")
    if (longest := max(len(e.input_ids) for e in examples)) > max_length:
        raise InputError(f"an example has {longest} tokens, more than max_length={max_length}")
    ds = grain.MapDataset.source(examples)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    rows = range(batch_size) if rows is None else [int(r) for r in rows]
    if any(not 0 <= r < batch_size for r in rows) or list(rows) != sorted(set(rows)):
        raise InputError(f"rows {list(rows)} must be ascending and lie in [0, {batch_size})")

    def collate(batch: list[Example]) -> dict:
        mine = [batch[r] for r in rows if r < len(batch)]
        return _collate(mine, batch_size=len(rows), max_length=max_length, pad_id=pad_id)

    return ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=collate).repeat(num_epochs)


def eval_examples(
    source: str, *, num_examples: int, fmt: str = "gsm8k", seed: int = 0
) -> list[tuple[list[dict], str]]:
    """Evaluation prompts: `(prompt_messages, reference_answer)` for the first `num_examples`
    usable rows of `source` (see `load_rows`; e.g. the GSM8K test split, or `"synthetic"` with
    `seed`). The prompt is every message before the final assistant turn; the reference is that
    turn's content (for GSM8K the worked answer ending in `#### <number>`). Rows with `tools`, or
    whose final turn calls tools, are not usable: the prompt carries no tools and the reference
    is an answer in text."""
    out = []
    for row in load_rows(source, num_rows=num_examples if source == SYNTHETIC else None, seed=seed):
        try:
            messages, last = _checked_messages(rows_to_messages(row, fmt))
        except SkipRow:
            continue
        if last == 0 or row_tools(row, fmt) or "tool_calls" in messages[last]:
            continue  # nothing to prompt with, or a tool-use row
        out.append((messages[:last], messages[last]["content"]))
        if len(out) == num_examples:
            break
    return out


def eval_source(cfg) -> tuple[str, str, int]:
    """(source, format, seed) of the evaluation prompts: ``data.eval_path`` read as
    ``data.eval_format`` ("" = as the training data), or, for synthetic training data, held-out
    synthetic problems (another seed)."""
    if cfg.data.source == SYNTHETIC:
        return SYNTHETIC, "gsm8k", cfg.seed + 1
    return cfg.data.eval_path, cfg.data.eval_format or cfg.data.source, cfg.seed
