"""Rows of a data file: `read_rows` decodes a JSON Lines, JSON or parquet file into dicts
(UTF-8/16/32 with or without a byte-order mark, any line ending; malformed lines skipped and
counted, or an error naming file and line), and `load_rows` also serves the built-in synthetic
problems (`SYNTHETIC`)."""

import codecs
import collections
import json
import re
from pathlib import Path

import pyarrow.parquet as pq
from absl import logging

from mars_jax import storage
from mars_jax.errors import InputError
from mars_jax.synthetic import arithmetic_problems

SYNTHETIC = "synthetic"  # source name of the built-in arithmetic problems (see `load_rows`)


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


def _decode_text(path: Path, raw: bytes) -> str:
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
                f"more than max_bad_fraction={max_bad_fraction}"
                if max_bad_fraction
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
    counted by `mars_jax.batches.build_examples`. A JSON array, or a UTF-16/32 file with invalid
    bytes, is read whole or not at all.

    Args:
      path: the file (local or ``gs://``).
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
    path = storage.Path(path)  # a local path or a gs:// URL
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        with path.open("rb") as f:
            return pq.read_table(f).to_pylist()
    if suffix not in (".jsonl", ".json"):
        raise InputError(f"{path}: expected a .jsonl, .json or .parquet file")
    raw = path.read_bytes()
    bom, codec, _ = _byte_order_mark(raw)
    body = raw[len(bom) :]
    if codec != "utf-8" or (suffix == ".json" and body.lstrip(b" \t\r\n").startswith(b"[")):
        text = _decode_text(path, raw)
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
