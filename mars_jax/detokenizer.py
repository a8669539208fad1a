"""Incremental detokenizing: the text of one completion as its tokens arrive, cut at stop strings.

One `Detokenizer` per completion serves every consumer of decoded text: ``generate --stream``
(`mars_jax.generate.TextStream`), the server's responses (`mars_jax.serve`) and the lm-eval
adapter's ``generate_until``. Tokens go through tokenizers' `DecodeStream` (Rust; it keeps the
offsets of the text already produced and holds back a character whose bytes are split across
tokens), so the work per token is bounded by the tokens of one character, not by the completion's
length. Stop strings are searched only where a new match can end: the last ``len(stop) - 1``
characters already seen plus the new text. Text that could still be the start of a stop string is
held back until it cannot, so no chunk ever has to be taken back.

A stop string ends the completion at the first token whose text completes it (the text is cut
before the match; with several stop strings the leftmost of those completed by that token): what
an OpenAI-style server returns, and what transformers' stop-string criterion followed by
lm-eval's ``until`` split gives. `tokens` counts the completion's tokens up to and including that
token; those after it are not read.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from tokenizers.decoders import DecodeStream

from mars_jax.tokenizer import Tokenizer

STOP = "stop"  # the finish reason of a stop id or string (OpenAI's)


class Detokenizer:
    """The text of one completion of ``tok``'s ids (a trimmed run's model ids too: mapped by
    ``tok.backend_ids``). `add` takes the next tokens and returns the text that is final; `finish` returns what was held back (an incomplete last character
    included). ``stop_ids`` end the completion without text (an EOS); ``stops`` are stop strings.

    Once a stop id or string ended the completion (``finish_reason`` "stop"; None otherwise,
    the budget being the caller's to know), further tokens are ignored. `text` is everything
    returned so far.
    """

    def __init__(self, tok: Tokenizer, stops: Sequence[str] = (), stop_ids: Iterable[int] = ()):
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self._backend, self._backend_ids = tok.backend, tok.backend_ids
        self._stream = DecodeStream(skip_special_tokens=True)
        self.stops = tuple(stops)
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._decoded = ""  # the text of the tokens read, complete characters only
        self._pending: list[int] = []  # tokens read since the last complete character
        self._last: list[int] = []  # the tokens of the last decoded chunk (context for finish)
        self._shown = 0  # characters of _decoded returned
        self.tokens = 0  # tokens read (the completion's, the stop string's own included)
        self.finish_reason: str | None = None
        self._closed = False  # `finish` was called

    @property
    def finished(self) -> bool:
        """A stop id or string ended the completion, or `finish` was called."""
        return self.finish_reason is not None or self._closed

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._decoded[: self._shown]

    def add(self, ids: Iterable[int]) -> str:
        """Reads ``ids`` (the next tokens of the completion) and returns the text that became
        final: everything decoded except an incomplete character and a tail that may begin a
        stop string ("" when nothing did)."""
        ids = [int(t) for t in ids]
        for t, backend_id in zip(ids, self._backend_ids(ids)):
            if self.finished:
                break
            if t in self.stop_ids:
                self.finish_reason = STOP
                break
            self.tokens += 1
            t = backend_id
            chunk = self._stream.step(self._backend, t)
            if chunk is None:
                self._pending.append(t)
                continue
            self._last, self._pending = self._pending + [t], []
            self._append(chunk)
        end = len(self._decoded) if self.finished else len(self._decoded) - self._hold
        return self._show(end)

    def finish(self) -> str:
        """Ends the completion and returns the text still held back: the tail kept for stop
        strings and an incomplete last character (decoded with a replacement character)."""
        if self._pending and not self.finished:
            context = self._backend.decode(self._last, skip_special_tokens=True)
            whole = self._backend.decode(self._last + self._pending, skip_special_tokens=True)
            self._pending = []
            self._append(whole[len(context) :])
        self._closed = True
        return self._show(len(self._decoded))

    def _append(self, chunk: str) -> None:
        start = max(0, len(self._decoded) - self._hold)
        self._decoded += chunk
        cuts = [i for i in (self._decoded.find(s, start) for s in self.stops) if i >= 0]
        if cuts:
            self._decoded = self._decoded[: min(cuts)]
            self.finish_reason = STOP

    def _show(self, end: int) -> str:
        end = max(end, self._shown)
        out = self._decoded[self._shown : end]
        self._shown = end
        return out
