"""OpenAI's completions and chat completions as requests of the continuous-batching
`engine.Engine` (the HTTP server is `mars_jax.serve`; the wire format's typed models are
`mars_jax.openai_protocol`): a request's JSON parsed once into one `engine.Request` per choice
(`Adapter.parse`: the model's name, the prompt's ids or the rendered chat, ``n``, the defaults
of the server's flags), the choices submitted together (`Adapter.start`: a refusal names the
request's own field), each decoded into `Piece`s of text (stop strings, log-probabilities, the
forwards up to the token read), and the answer's JSON (`Adapter.answer_body`, a streamed
`Adapter.chunk_body`, `usage` with ``tokens_per_forward``). No HTTP here.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import secrets
import time
import uuid
from typing import Sequence

from mars_jax import engine
from mars_jax import openai_protocol as protocol
from mars_jax.detokenizer import Detokenizer
from mars_jax.errors import InputError
from mars_jax.openai_protocol import RequestError


@dataclasses.dataclass
class Parsed:
    """A request as the engine takes it: one `engine.Request` per choice (``n`` for each prompt,
    prompt by prompt: OpenAI's choice indices), its prompt tokens (all prompts), its stop
    strings and whether it streams."""

    requests: list[engine.Request]
    prompt_tokens: int
    stops: list[str]
    streaming: bool
    kind: str = "completions"  # or "chat": the endpoint, which names the fields in errors
    budget_field: str = "max_tokens"  # or "max_completion_tokens": the field that set the budget


@dataclasses.dataclass
class Piece:
    """What one choice of a request received: its ``index``, final ``text``, ``finish_reason``
    once it ended, its counts so far, and ``logprobs`` [(id, logprob, [(id, logprob)])] of the
    tokens read (up to a stop string), where the request asked for them."""

    index: int
    text: str
    finish_reason: str | None
    tokens: int
    forwards: int
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None


class Adapter:
    """OpenAI's completions and chat completions over an `engine.Engine`: a request's JSON to
    engine requests (`parse`, once), its choices submitted and decoded into `Piece`s (`choices`),
    and the answer's JSON (`answer_body`, `chunk_body`)."""

    def __init__(
        self,
        eng: engine.Engine,
        tok,
        *,
        model_name: str,
        max_waiting: int,
        special_tokens: tuple[list[int], list[int]] = ([], []),
    ):
        """``special_tokens``: the ids the tokenizer adds before and after a completions prompt's
        text (`sources.Opened.special_tokens`: Llama 3's BOS), as transformers encodes it."""
        self.engine, self.tok, self.model_name = eng, tok, model_name
        self.max_waiting = max_waiting
        self.special_tokens = special_tokens

    # -- parsing ----------------------------------------------------------------------------------
    def parse(self, body: bytes | str, kind: str) -> Parsed:
        """The `Parsed` request of the JSON ``body`` of endpoint ``kind`` ("completions" or
        "chat"): the wire format checked by `openai_protocol.parse_request`, then what depends
        on this server (the model's name, the prompt's length, the largest budget, ``n``);
        `RequestError` naming the field otherwise."""
        req = protocol.parse_request(kind, body)
        if req.model not in (None, self.model_name):
            raise RequestError(
                f"model {req.model!r} is not served here (this server: {self.model_name!r})",
                "model",
                404,
            )
        if kind == "completions":
            prompts = req.prompts
            many = len(prompts) > 1
            ids = [
                self._prompt_ids(p, f"prompt[{k}]" if many else "prompt")
                for k, p in enumerate(prompts)
            ]
        else:
            for i, m in enumerate(req.messages):
                self._check_length(m.text, f"messages[{i}].content")
            messages = [{"role": m.template_role, "content": m.text} for m in req.messages]
            ids = [self.tok.apply_chat_template(messages, add_generation_prompt=True)]
        if req.choices * len(ids) > max(self.max_waiting, 1):
            each = f" for each of {len(ids)} prompts" if len(ids) > 1 else ""
            raise RequestError(
                f"n={req.choices}{each}: this server takes at most {self.max_waiting} choices",
                "n",
            )
        budgets = [self._budget(req, kind, p) for p in ids]
        default = self.engine.options  # the server's flags
        settings = dict(
            threshold=default.threshold if req.threshold is None else req.threshold,
            temperature=default.temperature if req.temperature is None else req.temperature,
            top_p=default.top_p if req.top_p is None else req.top_p,
            logprobs=req.alternatives,
        )
        # Choice i of a given seed decodes with seed + i (i counts the choices of every
        # prompt); without one, each choice gets a fresh seed, so that identical sampled
        # requests differ (OpenAI's way).
        requests = []
        for p, max_tokens in zip(ids, budgets):
            for _ in range(req.choices):
                i = len(requests)
                seed = (
                    secrets.randbelow(protocol.MAX_SEED + 1) if req.seed is None else req.seed + i
                )
                requests.append(
                    engine.Request(
                        tuple(p), max_tokens, seed=seed % (protocol.MAX_SEED + 1), **settings
                    )
                )
        _, budget_field = req.budget()
        return Parsed(requests, sum(map(len, ids)), req.stops, req.streaming, kind, budget_field)

    def _prompt_ids(self, prompt: str | list[int], where: str) -> list[int]:
        """A completions prompt's ids: token ids taken as they are, text tokenized as is."""
        if isinstance(prompt, list):
            return self._check_ids(prompt, where)
        self._check_length(prompt, where)
        before, after = self.special_tokens  # the chat template writes its own
        return before + self.tok.encode(prompt) + after

    def _budget(self, req, kind: str, ids: list[int]) -> int:
        """New tokens for a prompt of ``ids``: the request's budget as asked (the engine checks
        it against its largest and the model's context, `engine.Engine.check`), or the
        endpoint's default where it gives none, cut to what fits in the model's context."""
        asked, _ = req.budget()
        if asked is not None:
            return asked
        default = 16 if kind == "completions" else self.engine.max_new_tokens
        return max(min(default, self.engine.context - len(ids)), 1)

    def _check_ids(self, ids: list[int], where: str = "prompt") -> list[int]:
        """A prompt of the tokenizer's ids, as the model's rows (a trimmed run maps them)."""
        qwen = getattr(self.tok, "qwen", self.tok)  # a trimmed run's tokenizer wraps its own
        vocab = len(qwen)
        for k, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise RequestError(
                    f"{where}[{k}]: token id {t} is outside the vocabulary [0, {vocab})", where
                )
        if len(ids) > self.engine.max_prompt_len:  # refused before it is copied anywhere
            limit = self.engine.max_prompt_len
            raise RequestError(
                f"{where}: the prompt is {len(ids)} tokens; this server takes at most {limit}",
                where,
            )
        return list(ids) if qwen is self.tok else self.tok.model_ids(list(ids))

    def _check_length(self, text: str, param: str) -> None:
        # Far beyond any prompt that fits (a token is rarely under 1 character): refused unread.
        if len(text) > 64 * self.engine.max_prompt_len:
            raise RequestError(
                f"{param} is {len(text)} characters; too long for this server", param
            )

    # -- decoding ---------------------------------------------------------------------------------
    def start(self, parsed: Parsed) -> list[tuple[engine.Stream, asyncio.Queue]]:
        """Submits every choice of ``parsed`` to the engine now, each with the queue its updates
        arrive on; a choice the engine refuses (`engine.Engine.check`, once per choice) is a
        `RequestError` naming the request's own field, and none of the choices stays queued."""
        loop = asyncio.get_running_loop()
        started = []
        try:
            for request in parsed.requests:
                updates: asyncio.Queue = asyncio.Queue()
                put = lambda u, q=updates: loop.call_soon_threadsafe(q.put_nowait, u)
                started.append((self.engine.submit(request, put), updates))
        except (InputError, engine.EngineFailed) as e:
            for stream, _ in started:
                stream.cancel()
            if isinstance(e, engine.EngineFailed):
                raise RequestError(str(e), None, 503) from None
            raise _refusal(e, parsed) from None
        return started

    async def decode(self, index: int, stream: engine.Stream, updates: asyncio.Queue, stops):
        """Yields the `Piece`s of choice ``index`` (its ``stream`` and ``updates``, `start`) as
        its tokens are committed: one `Detokenizer` per choice, so the work per update is that
        of its new tokens. A stop string ends the choice at the token that completes it (its
        slot freed); the counts and log-probabilities cover the tokens returned up to there,
        never what the same forward accepted after. A failed or cancelled request raises
        `RequestError` (500, 503)."""
        text = Detokenizer(self.tok, stops)
        forwards = 0
        try:
            while True:
                update = await updates.get()
                if update.finish_reason == "error":  # a failed device call (engine.start)
                    raise RequestError(update.error or "decoding failed", None, 500)
                if update.finish_reason == "cancelled":  # the engine stopped: shutting down
                    raise RequestError("the server shut down before the request ended", None, 503)
                before = text.tokens
                delta = text.add(update.tokens)
                reason = text.finish_reason
                if reason is None and update.done:
                    delta += text.finish()
                    reason = "length" if update.finish_reason == "length" else "stop"
                read = text.tokens - before  # the tokens up to a stop string
                if read:  # the answer's forwards: up to its last token read
                    forwards = update.token_forwards[read - 1]
                logprobs = None
                if update.logprobs is not None:
                    logprobs = list(zip(update.tokens, update.logprobs, update.top_logprobs))[:read]
                if reason is not None:
                    stream.cancel()
                if delta or reason is not None or logprobs:
                    yield Piece(index, delta, reason, text.tokens, forwards, logprobs)
                if reason is not None:
                    return
        finally:
            stream.cancel()  # the client went away, or the request ended: free the slot

    def choices(self, parsed: Parsed):
        """The `Piece`s of every choice of ``parsed`` as they come (each choice decoded in a slot
        of its own), an async iterator; the choices are submitted now (`start`: a refusal is
        raised here, before any answer is sent). The first `RequestError` of any choice is
        raised, and leaving early (a client gone) cancels them all."""
        return self._pieces(parsed, self.start(parsed))

    async def _pieces(self, parsed: Parsed, started):
        pieces: asyncio.Queue = asyncio.Queue()

        async def pump(index, stream, updates):
            try:
                async for piece in self.decode(index, stream, updates, parsed.stops):
                    await pieces.put(piece)
            except RequestError as e:
                await pieces.put(e)
            finally:
                await pieces.put(None)

        tasks = [asyncio.create_task(pump(i, *s)) for i, s in enumerate(started)]
        try:
            running = len(tasks)
            while running:
                piece = await pieces.get()
                if piece is None:
                    running -= 1
                elif isinstance(piece, RequestError):
                    raise piece
                else:
                    yield piece
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def logprobs(self, kind: str, entries, offsets: TextOffsets | None = None):
        """The log-probabilities of ``entries`` (`Piece.logprobs`) in endpoint ``kind``'s shape
        (``offsets``: the completion's text before them; a stream passes the same one on)."""
        text = lambda t: self.tok.token_bytes(t).decode("utf-8", errors="replace")
        if kind == "chat":

            def top(t, lp):
                data = self.tok.token_bytes(t)
                return dict(
                    token=data.decode("utf-8", errors="replace"), logprob=lp, bytes=list(data)
                )

            content = [
                protocol.TokenLogprob(**top(t, lp), top_logprobs=[top(a, v) for a, v in alts])
                for t, lp, alts in entries
            ]
            return protocol.ChatLogprobs(content=content)
        offsets = offsets or TextOffsets()
        return protocol.CompletionLogprobs(
            tokens=[text(t) for t, _, _ in entries],
            token_logprobs=[lp for _, lp, _ in entries],
            top_logprobs=[{text(a): v for a, v in alts} for _, _, alts in entries],
            text_offset=offsets.of([self.tok.token_bytes(t) for t, _, _ in entries]),
        )

    def answer_body(self, parsed: Parsed, answer: Answer) -> dict:
        """The JSON body of the whole answer to ``parsed`` (not streamed)."""
        choices = [
            dict(
                index=i,
                text=answer.text[i],
                finish_reason=answer.reasons[i],
                logprobs=None
                if parsed.requests[i].logprobs is None
                else self.logprobs(parsed.kind, answer.logprobs[i]),
            )
            for i in range(len(parsed.requests))
        ]
        usage = answer.usage(parsed.prompt_tokens)
        return response_body(parsed.kind, self.model_name, response_id(parsed.kind), choices, usage)

    def chunk_body(self, parsed: Parsed, piece: Piece, answer: Answer, stream: StreamState) -> dict:
        """The JSON body of the streamed chunk of ``piece`` (already added to ``answer``), its
        ``usage`` in the chunk that ends the last choice."""
        i, kind = piece.index, parsed.kind
        logprobs = None
        if parsed.requests[i].logprobs is not None:
            logprobs = self.logprobs(kind, piece.logprobs or [], stream.offsets[i])
        choice = dict(
            index=i,
            text=piece.text,
            finish_reason=piece.finish_reason,
            logprobs=logprobs,
            first=i not in stream.started,
        )
        stream.started.add(i)
        usage = answer.usage(parsed.prompt_tokens) if answer.done else None
        return response_body(kind, self.model_name, stream.rid, [choice], usage, delta=True)


class TextOffsets:
    """Where each token's text starts in a completion's text, in characters (OpenAI's
    ``text_offset``): the tokens' bytes go through one incremental UTF-8 decoder, so a
    character split across tokens is counted once, by the token that completes it."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0  # characters of the text so far

    def of(self, pieces: Sequence[bytes]) -> list[int]:
        """The offsets of the next tokens, given their bytes."""
        out = []
        for data in pieces:
            out.append(self.chars)
            self.chars += len(self._decoder.decode(data))
        return out


def usage(prompt_tokens: int, tokens: Sequence[int], forwards: Sequence[int]) -> dict:
    """OpenAI's counts of a request whose choices returned ``tokens`` in ``forwards`` (each
    prompt counted once), and the tokens per forward of its rows."""
    total = sum(tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": total,
        "total_tokens": prompt_tokens + total,
        "tokens_per_forward": total / max(sum(forwards), 1),
    }


class Answer:
    """The choices of one request as their `Piece`s come: text, finish reasons, counts and
    log-probabilities per choice, and the seconds from the request's arrival (``arrived``, a
    ``time.perf_counter()``; None: not measured) to its first token."""

    def __init__(self, n: int, arrived: float | None = None):
        self.arrived = arrived
        self.first_token_seconds: float | None = None
        self.text, self.reasons = [""] * n, [None] * n
        self.tokens, self.forwards = [0] * n, [0] * n
        self.logprobs: list[list] = [[] for _ in range(n)]

    def add(self, piece: Piece) -> None:
        if piece.tokens and self.first_token_seconds is None and self.arrived is not None:
            self.first_token_seconds = time.perf_counter() - self.arrived
        i = piece.index
        self.text[i] += piece.text
        self.reasons[i] = piece.finish_reason
        self.tokens[i], self.forwards[i] = piece.tokens, piece.forwards
        self.logprobs[i] += piece.logprobs or []

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.reasons)

    def usage(self, prompt_tokens: int) -> dict:
        return usage(prompt_tokens, self.tokens, self.forwards)


def response_id(kind: str) -> str:
    return ("cmpl-" if kind == "completions" else "chatcmpl-") + uuid.uuid4().hex[:24]


def response_body(kind, model, rid, choices: list[dict], usage, *, delta=False) -> dict:
    """The JSON body of an answer of endpoint ``kind`` (id ``rid``), or with ``delta`` of one
    streamed chunk; each choice a dict of index, text, finish_reason, logprobs (an
    `openai_protocol` log-probabilities model or None) and, in a chat chunk, ``first`` (the
    chunk that names the role); ``usage`` (a dict) only where the request has ended."""
    common = {
        "id": rid,
        "created": int(time.time()),
        "model": model,
        "usage": None if usage is None else protocol.Usage.model_validate(usage),
    }
    if kind == "completions":
        choice = [protocol.CompletionChoice(**{k: c[k] for k in _CHOICE}) for c in choices]
        body = protocol.Completion(choices=choice, **common)
    elif delta:
        choice = [
            protocol.ChatChunkChoice(
                index=c["index"],
                delta=protocol.ChatDelta(
                    role="assistant" if c.get("first") else None, content=c["text"]
                ),
                finish_reason=c["finish_reason"],
                logprobs=c["logprobs"],
            )
            for c in choices
        ]
        body = protocol.ChatCompletionChunk(choices=choice, **common)
    else:
        choice = [
            protocol.ChatChoice(
                index=c["index"],
                message=protocol.ChatMessage(content=c["text"]),
                finish_reason=c["finish_reason"],
                logprobs=c["logprobs"],
            )
            for c in choices
        ]
        body = protocol.ChatCompletion(choices=choice, **common)
    return body.model_dump()


_CHOICE = ("index", "text", "finish_reason", "logprobs")


def _refusal(error: InputError, parsed: Parsed) -> RequestError:
    """The engine's refusal of a choice (`engine.Engine.check`) as the 400 of the request's own
    field: a chat's prompt is its ``messages``, its log-probabilities ``top_logprobs``, the
    budget the field that set it."""
    field, message = getattr(error, "field", None), str(error)
    if field == "prompt" and parsed.kind == "chat":
        field = "messages"
        message = f"{field}: {message.removeprefix('prompt: ')}"
    elif field == "logprobs" and parsed.kind == "chat":  # chat counts in top_logprobs
        field = "top_logprobs" if error.value else "logprobs"
        message = f"{field}: {error.value}; {error.reason}"
    elif field == "max_tokens" and parsed.budget_field != field:
        field = parsed.budget_field
        message = f"{field}: {error.value}; {error.reason}"
    return RequestError(message, field)


@dataclasses.dataclass
class StreamState:
    """What a streamed answer carries from chunk to chunk: its id, the choices that have sent
    a chunk (a chat's first names the role), and each choice's text offsets."""

    rid: str
    started: set
    offsets: list

    @classmethod
    def of(cls, parsed: Parsed) -> StreamState:
        offsets = [TextOffsets() for _ in parsed.requests]
        return cls(response_id(parsed.kind), set(), offsets)
