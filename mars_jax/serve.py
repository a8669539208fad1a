r"""An OpenAI-compatible HTTP server for a MARS run, on the continuous-batching `engine.Engine`.

  python -m mars_jax.serve --workdir=runs/mars --port=8000 [--host=127.0.0.1 --slots=8
      --threshold=0.95 --max_prompt_len=1024 --max_new_tokens=512 --max_waiting=64
      --prefill_chunk=256 --mesh=1,1,8 --temperature=0 --top_p=1 --rule prob --max_failures=3
      --max_logprobs=20 --warmup]

The decoding flags (`cli.DecodingFlags`) are one `DecodeOptions`: each request's defaults.

Endpoints: ``POST /v1/completions`` (``prompt``: a non-empty string, tokenized as is, or token
ids, or a list of such prompts, each with its ``n`` choices) and ``POST /v1/chat/completions`` (``messages``: roles system, developer (rendered as
system), user, assistant, each content a string or a list of text parts, rendered with the
run's chat template), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus,
`mars_jax.serve_metrics`).
Requests and responses are the typed models of `mars_jax.openai_protocol` (OpenAI's wire
format, read in strict mode: a boolean is not a number, a float not an integer). Per request:
``model`` (this server's name, or absent), ``max_tokens`` or ``max_completion_tokens`` (default
16 for completions, the server's ``--max_new_tokens`` for chat; at most that), ``temperature``
(in [0, 2]; default ``--temperature``, 0: greedy; MARS accepts several tokens per forward where
it is confident), ``top_p`` (in (0, 1]; nucleus sampling, default ``--top_p``), ``seed`` (0 to
2**32-1; default: a fresh one per request), ``n`` (choices, 1 to 128, each in a slot of its
own; choice i of a seed s decodes with seed s + i), ``logprobs`` (completions: 0 to 5
alternatives; chat: true, with ``top_logprobs`` 0 to 20; at most ``--max_logprobs``: each
returned token's log-probability under the model, in the forward that chose it), ``stop`` (a
string or a list of up to 4, none empty), ``stream`` (server-sent events, ``data: [DONE]``
last), and the extra field ``threshold`` (in (0, 1]; default ``--threshold``; 1.0 is exactly AR
decoding). ``user`` and ``stream_options`` are accepted and ignored; OpenAI's fields this
server does not implement (``best_of``, ``frequency_penalty``, ``presence_penalty``, ``echo``,
``logit_bias``, ``suffix``, ``response_format``) are accepted only at their neutral values
(``openai_protocol.UNSUPPORTED``) or null; any other field is refused. ``usage`` adds
``tokens_per_forward`` to OpenAI's token counts.

Errors are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad
request (``param`` is the field, from the validation error's location: ``max_tokens``,
``messages[1].content``, ``stop[0]``; the message names it too), 404 for an unknown path or
model, 429 when ``--max_waiting`` requests already wait for a slot, 503 while shutting down. A
client that disconnects frees its slot, streaming or not. A prompt and budget beyond the
model's context (``max_position_embeddings``) are a 400 naming it. SIGTERM stops accepting
requests, lets those in flight finish, and exits 0. Built on aiohttp.

A failed device call (see `engine.Engine.start`) answers the requests in flight with a 500 in
the same shape (a streamed one: as its last event, before ``data: [DONE]``); ``/health`` is 503
("recovering") until the engine decodes again, and 500 ("failed") if it gives up, when the
server stops and exits 1 for a supervisor to restart it. ``/health`` is 200 only while "ok".
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import json
import os
import secrets
import signal
import socket
import threading
import time
import uuid
from typing import Sequence

from absl import flags, logging
from aiohttp import web

from mars_jax import cli, engine, serve_metrics, sharding, sources
from mars_jax import openai_protocol as protocol
from mars_jax.decode_options import DecodeOptions
from mars_jax.detokenizer import Detokenizer
from mars_jax.errors import InputError
from mars_jax.openai_protocol import RequestError


def error_response(message: str, status: int, param: str | None = None) -> web.Response:
    """OpenAI's error body (`openai_protocol.ErrorResponse`) with ``status``."""
    body = protocol.ErrorResponse.of(message, status, param)
    return web.json_response(body.model_dump(), status=status)


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


class Server:
    """The request handling of `build_app`: parsing, prompt ids, and the text of each stream."""

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
        self.metrics = serve_metrics.ServerMetrics(eng)
        self.max_waiting = max_waiting
        self.special_tokens = special_tokens
        self.closing = False

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


def build_app(server: Server) -> web.Application:
    """The aiohttp application of ``server``: the endpoints of the module docstring."""

    @web.middleware
    async def observed(request: web.Request, handler):
        """Each completion request's status, latency and choices into ``server.metrics``."""
        if request.method != "POST":
            return await handler(request)
        request[ARRIVED] = start = time.perf_counter()
        response = await handler(request)
        server.metrics.observe(
            request.path,
            response.status,
            time.perf_counter() - start,
            request.get(ANSWER),
            request.get(PROMPT_TOKENS, 0),
        )
        return response

    async def metrics(_):
        return web.Response(
            body=server.metrics.scrape(), headers={"Content-Type": serve_metrics.CONTENT_TYPE}
        )

    app = web.Application(client_max_size=4 << 20, middlewares=[observed])

    async def health(_):
        eng = server.engine
        status, code = "ok", 200
        if eng.dead.is_set():
            status, code = "failed", 500
        elif server.closing:
            status, code = "closing", 503
        elif not eng.healthy:
            status, code = "recovering", 503
        body = {"status": status, "active": eng.active, "waiting": eng.waiting}
        body |= {"failures": eng.failures, "last_error": eng.last_error}
        return web.json_response(body, status=code)

    async def models(_):
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "mars-jax",
                    }
                ],
            }
        )

    def handler(kind: str):
        async def handle(request: web.Request):
            if server.closing:
                return error_response("the server is shutting down", 503)
            try:
                parsed = server.parse(await request.read(), kind)
                if server.engine.waiting + len(parsed.requests) > server.max_waiting:
                    raise RequestError(
                        "the server is busy: too many requests wait for a slot", None, 429
                    )
                if server.engine.dead.is_set():
                    raise RequestError(
                        f"the decoding engine failed: {server.engine.last_error}", None, 503
                    )
                request[PROMPT_TOKENS] = parsed.prompt_tokens
                pieces = server.choices(parsed)
                try:
                    if parsed.streaming:
                        return await _stream(request, kind, server, parsed, pieces)
                    answer = request[ANSWER] = _Answer(len(parsed.requests), request)
                    async for piece in pieces:
                        answer.add(piece)
                finally:
                    await pieces.aclose()  # a client gone mid-request frees its slots
                choices = [
                    dict(
                        index=i,
                        text=answer.text[i],
                        finish_reason=answer.reasons[i],
                        logprobs=None
                        if parsed.requests[i].logprobs is None
                        else server.logprobs(kind, answer.logprobs[i]),
                    )
                    for i in range(len(parsed.requests))
                ]
                body = _body(
                    kind, server.model_name, _rid(kind), choices, answer.usage(parsed.prompt_tokens)
                )
                return web.json_response(body)
            except RequestError as e:
                return error_response(str(e), e.status, e.param)
            except InputError as e:  # e.g. a prompt with a token a trimmed run lacks
                return error_response(str(e), 400)

        return handle

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", handler("completions"))
    app.router.add_post("/v1/chat/completions", handler("chat"))
    return app


# What a completion request leaves for the metrics middleware (`build_app`).
ARRIVED = web.RequestKey("arrived", float)  # time.perf_counter() at its arrival
ANSWER = web.RequestKey("answer", object)  # its `_Answer`
PROMPT_TOKENS = web.RequestKey("prompt_tokens", int)


class _Answer:
    """The choices of one request as their `Piece`s come: text, finish reasons, counts and
    log-probabilities per choice, and the seconds from the request's arrival (``request``'s,
    `build_app`'s middleware) to its first token."""

    def __init__(self, n: int, request=None):
        self.arrived = request.get(ARRIVED) if request is not None else None
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


def _rid(kind: str) -> str:
    return ("cmpl-" if kind == "completions" else "chatcmpl-") + uuid.uuid4().hex[:24]


def _body(kind, model, rid, choices: list[dict], usage, *, delta=False) -> dict:
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


async def _stream(request, kind, server, parsed: Parsed, pieces) -> web.StreamResponse:
    """Server-sent events: one chunk per `Piece` (its choice's index), ``usage`` in the chunk
    that ends the last choice, an error as the last event, then ``data: [DONE]``."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    rid, answer = _rid(kind), _Answer(len(parsed.requests), request)
    request[ANSWER] = answer
    started, offsets = set(), [TextOffsets() for _ in parsed.requests]
    try:
        try:
            async for piece in pieces:
                answer.add(piece)
                i = piece.index
                logprobs = None
                if parsed.requests[i].logprobs is not None:
                    logprobs = server.logprobs(kind, piece.logprobs or [], offsets[i])
                choice = dict(
                    index=i,
                    text=piece.text,
                    finish_reason=piece.finish_reason,
                    logprobs=logprobs,
                    first=i not in started,
                )
                started.add(i)
                usage = answer.usage(parsed.prompt_tokens) if answer.done else None
                body = _body(kind, server.model_name, rid, [choice], usage, delta=True)
                await response.write(f"data: {json.dumps(body)}\n\n".encode())
        except RequestError as e:  # the status line is sent: the error is the last event
            await response.write(f"data: {e.body().model_dump_json()}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
    except ConnectionResetError:  # the client went away: the caller frees the slot
        pass
    return response


class Background:
    """``app`` served on ``host``:``port`` by an event loop in a daemon thread (for tests and the
    load benchmark; the command line uses aiohttp's ``run_app``). `close` stops it."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0):
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, host, port)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://{host}:{self.port}"
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="mars-serve", daemon=True)
        self.thread.start()
        if not ready.wait(60):
            raise RuntimeError("the server did not start within 60 s")

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def mesh_for(workdir: str, mesh_shape: Sequence[int] | None, slots: int):
    """(mesh, axis rules) of (data, fsdp, tensor) sizes ``mesh_shape`` (-1 takes the rest) for
    the model in ``workdir``: its parameters and the ``slots`` sharded by its rules;
    (None, None) without a shape (one device's decoder)."""
    if mesh_shape is None:
        return None, None
    mesh = sharding.make_mesh(*mesh_shape)
    rows = mesh.shape["data"] * mesh.shape["fsdp"]
    if slots % rows:
        raise InputError(f"slots: {slots}; must be a multiple of data x fsdp = {rows}")
    return mesh, sources.sharding_rules(workdir)


def make_server(
    opened: sources.Opened,
    options: DecodeOptions,
    *,
    slots: int,
    max_prompt_len: int,
    max_waiting: int,
    steps_per_call: int = 4,
    prefill_chunk: int | None = None,
    mesh=None,
    axis_rules=None,
    model_name: str | None = None,
    max_failures: int = 3,
    max_logprobs: int | None = protocol.MAX_TOP_LOGPROBS,
    warmup: bool = False,
) -> Server:
    """The `Server` of the model ``opened`` (`sources.open`, on ``mesh`` if given), its engine
    started: ``options`` are the requests' defaults, ``options.max_new_tokens`` the largest
    budget a request may ask for, ``max_logprobs`` the most alternatives per token (None: no
    log-probabilities); ``warmup`` compiles every prefill shape first (`engine.Engine.warmup`;
    without it, the first request of each shape waits for a compile)."""
    eng = engine.Engine(
        opened.model,
        options,
        slots=slots,
        max_prompt_len=max_prompt_len,
        **opened.decode_ids(),
        steps_per_call=steps_per_call,
        prefill_chunk=prefill_chunk,
        max_failures=max_failures,
        logprobs=max_logprobs,
        mesh=mesh,
        axis_rules=axis_rules,
    )
    if warmup:  # every prefill shape compiled before the first request (Engine.warmup)
        eng.warmup()
    eng.start()
    name = model_name or os.path.basename(os.path.normpath(opened.path))
    return Server(
        eng,
        opened.tokenizer,
        model_name=name,
        max_waiting=max_waiting,
        special_tokens=opened.special_tokens(),
    )


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port``; `InputError` (one line) where it cannot be had
    (a port in use, an address not of this host)."""
    try:
        return socket.create_server((host, port))
    except OSError as e:
        raise InputError(f"--host/--port: cannot listen on {host}:{port}: {e.strerror}") from None


def main() -> None:
    workdir = cli.workdir_flag(
        "The run (its latest checkpoint) or Hugging Face directory to serve."
    )
    decoding = cli.DecodingFlags(
        threshold=0.95,
        max_new_tokens=512,
        threshold_help="Default threshold of a request.",
        budget_help="Largest max_tokens of a request.",
    )
    host = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
    port = flags.DEFINE_integer("port", 8000, "Port to listen on.")
    slots = flags.DEFINE_integer("slots", 8, "Requests decoded together.")
    max_prompt = flags.DEFINE_integer("max_prompt_len", 1024, "Longest prompt, in tokens.")
    max_waiting = flags.DEFINE_integer("max_waiting", 64, "Requests waiting for a slot (429).")
    steps = flags.DEFINE_integer("steps_per_call", 4, "Forwards per device call.")
    chunk = flags.DEFINE_integer("prefill_chunk", 256, "Prompt tokens per prefill forward.")
    mesh_sizes = flags.DEFINE_list(
        "mesh", None, "data,fsdp,tensor sizes of a mesh over this host's devices (e.g. 1,1,8)."
    )
    name = flags.DEFINE_string("model_name", None, "Model id (default: the workdir's name).")
    max_failures = flags.DEFINE_integer(
        "max_failures", 3, "Failed device calls in a row after which the server exits 1."
    )
    max_logprobs = flags.DEFINE_integer(
        "max_logprobs", protocol.MAX_TOP_LOGPROBS, "Most top_logprobs a request may ask for."
    )
    warmup = flags.DEFINE_bool(
        "warmup", False, "Compile every prefill shape before answering (Engine.warmup)."
    )

    def run():
        sock = listen(host.value, port.value)  # before the model loads: a port in use fails fast
        shape = None if mesh_sizes.value is None else [int(n) for n in mesh_sizes.value]
        mesh, rules = mesh_for(workdir.value, shape, slots.value)
        opened, options = decoding.open(workdir.value, mesh=mesh)
        server = make_server(
            opened,
            options,
            slots=slots.value,
            max_prompt_len=max_prompt.value,
            max_waiting=max_waiting.value,
            steps_per_call=steps.value,
            prefill_chunk=chunk.value,
            mesh=mesh,
            axis_rules=rules,
            model_name=name.value,
            max_failures=max_failures.value,
            max_logprobs=max_logprobs.value,
            warmup=warmup.value,
        )
        app = build_app(server)
        # The engine gave up (engine.Engine.start): shut down as on SIGTERM, then exit 1.
        server.engine.on_dead = lambda: os.kill(os.getpid(), signal.SIGTERM)

        async def closing(_):
            server.closing = True

        app.on_shutdown.append(closing)
        logging.info("serving %s on http://%s:%d", server.model_name, host.value, port.value)
        web.run_app(
            app,
            sock=sock,
            print=None,
            shutdown_timeout=60,
            handler_cancellation=True,  # a client gone mid-request cancels its handler
        )
        server.engine.stop()
        if server.engine.dead.is_set():
            raise SystemExit(f"error: the decoding engine failed: {server.engine.last_error}")

    cli.run(run)


if __name__ == "__main__":
    main()
