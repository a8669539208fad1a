"""Chat rendering of one conversation for MARS SFT: a row's messages and tools (validated: roles,
content, OpenAI tool calls and tool messages), rendered with the checkpoint's chat template and
tokenized with labels (`tokenize_chat`), as the MARS reference's SFT data path does (arXiv
2604.07023): the tokens of the final assistant turn (its content and closing ``<|im_end|>``)
are the labels; the sequence ends there and is padded with labelled ``<|im_end|>`` up to a
multiple of the block size, so the model learns to fill the rest of a block with EOS. A row
that cannot be trained on raises `SkipRow`."""

import json
import re

import jinja2
import numpy as np

from mars_jax.common_types import IGNORE_INDEX
from mars_jax.errors import InputError
from mars_jax.tokenizer import CONTROL_TOKENS, MASK_TOKEN, TemplateTimeout

# Strings that the tokenizer turns into control tokens: in content they would end a turn early
# or put <|mask|> into the clean stream, so such rows are skipped.
_SPECIAL_STRINGS = tuple(text for _, text, special in CONTROL_TOKENS if special) + (MASK_TOKEN,)
_SURROGATE = re.compile("[\ud800-\udfff]")
# Seconds one rendering of a training row may take (a template that loops for ever, or nearly:
# the row is skipped and counted as template_timeout; main thread only, see render_chat).
RENDER_SECONDS = 10.0


class SkipRow(Exception):
    """A row that cannot be trained on; `reason` (str) is the key it is counted under."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


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


def _check_text(text: str, forbidden: tuple[str, ...] = _SPECIAL_STRINGS) -> None:
    """SkipRow("special_token_in_content") for a control-token string (`forbidden`: the
    tokenizer's `control_strings`, Qwen's by default) in `text`;
    SkipRow("lone_surrogate") for an unpaired UTF-16 surrogate (a JSON escape such as "\\ud800"
    without its pair), which is no Unicode text and cannot be tokenized."""
    if any(t in text for t in forbidden):
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


def _checked_tools(tools, forbidden: tuple[str, ...] = _SPECIAL_STRINGS) -> list[dict] | None:
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
    _check_text(_json_text(tools, "bad_tools"), forbidden)
    return tools


def _checked_message(m, forbidden: tuple[str, ...] = _SPECIAL_STRINGS) -> dict:
    """A copy of one message with role, content and the tool-use fields that are set (see
    `tokenize_chat`); an assistant message with tool calls may lack content (None -> "")."""
    if not isinstance(m, dict) or "role" not in m:
        raise SkipRow("missing_field")
    calls = m.get("tool_calls") or None  # [] and None: no calls
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise SkipRow("bad_tool_calls")
        calls = [_checked_tool_call(c) for c in calls]
        _check_text(_json_text(calls, "bad_tool_calls"), forbidden)
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
        _check_text(text, forbidden)
    return {"role": m["role"], **texts, **({"tool_calls": calls} if calls else {})}


def checked_messages(
    messages: list, forbidden: tuple[str, ...] = _SPECIAL_STRINGS
) -> tuple[list[dict], int]:
    """Validates messages; returns copies of them (see `_checked_message`) and the index of the
    final assistant turn. Raises SkipRow with the reason of the first problem found."""
    clean = [_checked_message(m, forbidden) for m in messages]
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
            rendered = tokenizer.render_chat(
                probe_messages, tools=probe_tools, time_limit=RENDER_SECONDS
            )
            same = rendered == full
        except TemplateTimeout:
            raise
        except jinja2.TemplateError:  # the template reads what the probe took away
            same = False
        if same:
            raise SkipRow("tools_not_rendered")


def chat_segments(
    tokenizer, messages: list, all_assistant_turns: bool, tools=None
) -> list[tuple[str, bool]]:
    """Splits the rendered conversation into `(text, labelled)` pieces that end at the final
    assistant turn's `<|im_end|>`. An assistant turn at message k is located by rendering
    `messages[:k]` with the generation prompt, which must be a prefix of the full rendering; its
    labelled piece runs from there through the next `<|im_end|>`, and must hold more than
    whitespace (else SkipRow("empty_answer"))."""
    forbidden = tuple(getattr(tokenizer, "control_strings", None) or _SPECIAL_STRINGS)
    messages, last = checked_messages(messages, forbidden)
    tools = _checked_tools(tools, forbidden)
    messages = messages[: last + 1]
    full = tokenizer.render_chat(messages, tools=tools, time_limit=RENDER_SECONDS)
    _check_tool_use_rendered(tokenizer, messages, tools, full)
    eos = tokenizer.decode([tokenizer.eos_id], skip_special_tokens=False)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    segments, pos = [], 0
    for k in turns if all_assistant_turns else [last]:
        prompt = tokenizer.render_chat(
            messages[:k], add_generation_prompt=True, tools=tools, time_limit=RENDER_SECONDS
        )
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


def assemble(
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


def check_lengths(max_length: int, block_size: int) -> None:
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
    check_lengths(max_length, block_size)
    texts, labelled = zip(*chat_segments(tokenizer, messages, all_assistant_turns, tools))
    return assemble(
        tokenizer.encode_batch(list(texts)),
        list(labelled),
        max_length=max_length,
        block_size=block_size,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        truncate=truncate,
    )
