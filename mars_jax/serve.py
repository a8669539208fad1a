r"""An OpenAI-compatible HTTP server for a MARS run, on the continuous-batching `engine.Engine`.

  python -m mars_jax.serve --workdir=runs/mars --port=8000 [--host=127.0.0.1 --slots=8
      --threshold=0.95 --max_prompt_len=1024 --max_new_tokens=512 --max_waiting=64
      --prefill_chunk=256 --mesh=1,1,8 --temperature=0 --rule prob --max_failures=3]

The decoding flags (`cli.DecodingFlags`) are one `DecodeOptions`: each request's defaults.

Endpoints: ``POST /v1/completions`` (``prompt``: a non-empty string, tokenized as is) and ``POST
/v1/chat/completions`` (``messages``: roles system, user, assistant, each content a string or a
list of text parts, rendered with the run's chat template), ``GET /v1/models``, ``GET /health``.
Requests and responses are the typed models of `mars_jax.openai_protocol` (OpenAI's wire
format, read in strict mode: a boolean is not a number, a float not an integer). Per request:
``model`` (this server's name, or absent), ``max_tokens`` or ``max_completion_tokens`` (default
16 for completions, the server's ``--max_new_tokens`` for chat; at most that), ``temperature``
(in [0, 2]; default ``--temperature``, 0: greedy; MARS accepts several tokens per forward where
it is confident), ``seed`` (0 to 2**32-1; default: a fresh one per request), ``stop`` (a string
or a list of up to 4, none empty), ``stream`` (server-sent events, ``data: [DONE]`` last), and the extra field ``threshold`` (in (0, 1];
default ``--threshold``; 1.0 is exactly AR decoding). ``user`` and ``stream_options`` are
accepted and ignored; OpenAI's fields this server does not implement (``n``, ``best_of``,
``top_p``, ``frequency_penalty``, ``presence_penalty``, ``logprobs``, ``top_logprobs``,
``echo``, ``logit_bias``, ``suffix``, ``response_format``) are accepted only at their neutral
values (``openai_protocol.UNSUPPORTED``) or null; any other field is refused. ``usage`` adds
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
import json
import os
import secrets
import signal
import threading
import time
import uuid
from typing import Sequence

from absl import flags, logging
from aiohttp import web

from mars_jax import cli, engine, sharding, sources
from mars_jax import openai_protocol as protocol
from mars_jax.decode_options import DecodeOptions
from mars_jax.detokenizer import Detokenizer
from mars_jax.errors import InputError
from mars_jax.openai_protocol import RequestError


def error_response(message: str, status: int, param: str | None = None) -> web.Response:
    """OpenAI's error body (`openai_protocol.ErrorResponse`) with ``status``."""
    body = protocol.ErrorResponse.of(message, status, param)
    return web.json_response(body.model_dump(), status=status)


class Server:
    """The request handling of `build_app`: parsing, prompt ids, and the text of each stream."""

    def __init__(self, eng: engine.Engine, tok, *, model_name: str, max_waiting: int):
        self.engine, self.tok, self.model_name = eng, tok, model_name
        self.max_waiting = max_waiting
        self.closing = False

    # -- parsing ----------------------------------------------------------------------------------
    def parse(
        self, body: bytes | str, kind: str
    ) -> tuple[list[int], engine.Request, list[str], bool]:
        """(prompt ids, engine request, stop strings, streaming) of the JSON ``body`` of endpoint
        ``kind`` ("completions" or "chat"): the wire format checked by
        `openai_protocol.parse_request`, then what depends on this server (the model's name, the
        prompt's length, the largest budget); `RequestError` naming the field otherwise."""
        req = protocol.parse_request(kind, body)
        if req.model not in (None, self.model_name):
            raise RequestError(
                f"model {req.model!r} is not served here (this server: {self.model_name!r})",
                "model",
                404,
            )
        if kind == "completions":
            self._check_length(req.prompt, "prompt")
            ids, where = self.tok.encode(req.prompt), "prompt"
        else:
            for i, m in enumerate(req.messages):
                self._check_length(m.text, f"messages[{i}].content")
            messages = [{"role": m.role, "content": m.text} for m in req.messages]
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True)
            where = "messages"
        limit = self.engine.max_prompt_len
        if len(ids) > limit:
            raise RequestError(
                f"{where}: the prompt is {len(ids)} tokens; this server takes at most {limit}",
                where,
            )
        largest, context = self.engine.max_new_tokens, self.engine.context
        room = context - len(ids)  # new tokens that fit in the model's context after the prompt
        if room < 1:
            raise RequestError(
                f"{where}: the prompt is {len(ids)} tokens; the model's context is {context}",
                where,
            )
        asked, field = req.budget()
        if asked is None:  # as much as this endpoint's default, and as fits
            max_tokens = min(16 if kind == "completions" else largest, room)
        elif asked > largest:
            raise RequestError(f"{field}={asked!r} must lie in [1, {largest}]", field)
        elif asked > room:
            raise RequestError(
                f"{field}={asked}: the prompt ({len(ids)} tokens) and {asked} new tokens exceed "
                f"the model's context of {context} tokens; at most {room} fit",
                field,
            )
        else:
            max_tokens = asked
        default = self.engine.options  # the server's flags
        request = engine.Request(
            tuple(ids),
            max_tokens,
            threshold=default.threshold if req.threshold is None else req.threshold,
            temperature=default.temperature if req.temperature is None else req.temperature,
            # No seed: a fresh one, so that identical sampled requests differ (OpenAI's way).
            seed=secrets.randbelow(protocol.MAX_SEED + 1) if req.seed is None else req.seed,
        )
        return ids, request, req.stops, req.streaming

    def _check_length(self, text: str, param: str) -> None:
        # Far beyond any prompt that fits (a token is rarely under 1 character): refused unread.
        if len(text) > 64 * self.engine.max_prompt_len:
            raise RequestError(
                f"{param} is {len(text)} characters; too long for this server", param
            )

    # -- decoding ---------------------------------------------------------------------------------
    async def decode(self, ids, request: engine.Request, stops: list[str]):
        """Yields (text delta, finish_reason or None, usage or None) as tokens are committed:
        one `Detokenizer` per request, so the work per update is that of its new tokens. A stop
        string ends the request at the token that completes it (its slot freed); the counts
        cover the tokens returned up to there, never what the same forward accepted after."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        stream = self.engine.submit(
            request, lambda u: loop.call_soon_threadsafe(updates.put_nowait, u)
        )
        text = Detokenizer(self.tok, stops)
        try:
            while True:
                update = await updates.get()
                if update.finish_reason == "error":  # a failed device call (engine.start)
                    raise RequestError(update.error or "decoding failed", None, 500)
                if update.finish_reason == "cancelled":  # the engine stopped: shutting down
                    raise RequestError("the server shut down before the request ended", None, 503)
                delta = text.add(update.tokens)
                reason = text.finish_reason
                if reason is None and update.done:
                    delta += text.finish()
                    reason = "length" if update.finish_reason == "length" else "stop"
                usage = None
                if reason is not None:
                    stream.cancel()
                    usage = {
                        "prompt_tokens": len(ids),
                        "completion_tokens": text.tokens,
                        "total_tokens": len(ids) + text.tokens,
                        "tokens_per_forward": text.tokens / max(update.forwards, 1),
                    }
                if delta or reason is not None:
                    yield delta, reason, usage
                if reason is not None:
                    return
        finally:
            stream.cancel()  # the client went away, or the request ended: free the slot


def build_app(server: Server) -> web.Application:
    """The aiohttp application of ``server``: the endpoints of the module docstring."""
    app = web.Application(client_max_size=4 << 20)

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
                ids, req, stops, streaming = server.parse(await request.read(), kind)
                try:
                    server.engine.check(req)
                except InputError as e:
                    field = getattr(e, "field", None)
                    if field == "prompt" and kind == "chat":
                        field = "messages"
                    raise RequestError(str(e), field) from None
                if server.engine.waiting >= server.max_waiting:
                    raise RequestError(
                        "the server is busy: too many requests wait for a slot", None, 429
                    )
                if server.engine.dead.is_set():
                    raise RequestError(
                        f"the decoding engine failed: {server.engine.last_error}", None, 503
                    )
                chunks = server.decode(ids, req, stops)
                try:
                    if streaming:
                        return await _stream(request, kind, server, chunks)
                    text, reason, usage = "", None, None
                    async for delta, reason, usage in chunks:
                        text += delta
                finally:
                    await chunks.aclose()  # a client gone mid-request frees its slot
                return web.json_response(_body(kind, server.model_name, text, reason, usage))
            except RequestError as e:
                return error_response(str(e), e.status, e.param)
            except InputError as e:  # e.g. a prompt with a token a trimmed run lacks
                return error_response(str(e), 400)

        return handle

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", handler("completions"))
    app.router.add_post("/v1/chat/completions", handler("chat"))
    return app


def _body(kind, model, text, reason, usage, *, delta=False, first=False) -> dict:
    """The JSON body of an answer of endpoint ``kind``, or with ``delta`` of one streamed chunk
    (``first``: the chunk that names the role); ``usage`` (a dict or `openai_protocol.Usage`)
    only where the request has ended."""
    rid = ("cmpl-" if kind == "completions" else "chatcmpl-") + uuid.uuid4().hex[:24]
    common = {
        "id": rid,
        "created": int(time.time()),
        "model": model,
        "usage": None if usage is None else protocol.Usage.model_validate(usage),
    }
    if kind == "completions":
        choice = protocol.CompletionChoice(text=text, finish_reason=reason)
        body = protocol.Completion(choices=[choice], **common)
    elif delta:
        content = protocol.ChatDelta(role="assistant" if first else None, content=text)
        choice = protocol.ChatChunkChoice(delta=content, finish_reason=reason)
        body = protocol.ChatCompletionChunk(choices=[choice], **common)
    else:
        message = protocol.ChatMessage(content=text)
        choice = protocol.ChatChoice(message=message, finish_reason=reason)
        body = protocol.ChatCompletion(choices=[choice], **common)
    return body.model_dump()


async def _stream(request, kind, server, chunks) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    first = True
    try:
        try:
            async for delta, reason, usage in chunks:
                body = _body(kind, server.model_name, delta, reason, usage, delta=True, first=first)
                first = False
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
) -> Server:
    """The `Server` of the model ``opened`` (`sources.open`, on ``mesh`` if given), its engine
    started: ``options`` are the requests' defaults, ``options.max_new_tokens`` the largest
    budget a request may ask for."""
    eng = engine.Engine(
        opened.model,
        options,
        slots=slots,
        max_prompt_len=max_prompt_len,
        **opened.decode_ids(),
        steps_per_call=steps_per_call,
        prefill_chunk=prefill_chunk,
        max_failures=max_failures,
        mesh=mesh,
        axis_rules=axis_rules,
    )
    eng.start()
    name = model_name or os.path.basename(os.path.normpath(opened.path))
    return Server(eng, opened.tokenizer, model_name=name, max_waiting=max_waiting)


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

    def run():
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
            host=host.value,
            port=port.value,
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
