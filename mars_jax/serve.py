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
import functools
import json
import os
import signal
import socket
import threading
import time
from typing import Sequence

from absl import flags, logging
from aiohttp import web

from mars_jax import cli, engine, serve_metrics, sharding, sources
from mars_jax import openai_protocol as protocol
from mars_jax.decode_options import DecodeOptions
from mars_jax.errors import InputError
from mars_jax.openai_adapter import Adapter, Answer, Parsed, StreamState
from mars_jax.openai_protocol import RequestError


def error_response(message: str, status: int, param: str | None = None) -> web.Response:
    """OpenAI's error body (`openai_protocol.ErrorResponse`) with ``status``."""
    body = protocol.ErrorResponse.of(message, status, param)
    return web.json_response(body.model_dump(), status=status)


class Server(Adapter):
    """The `Adapter` as the HTTP server holds it: with the Prometheus metrics of its requests
    (`serve_metrics`) and whether it is shutting down."""

    def __init__(self, eng: engine.Engine, tok, **kwargs):
        super().__init__(eng, tok, **kwargs)
        self.metrics = serve_metrics.ServerMetrics(eng)
        self.closing = False


SERVER = web.AppKey("server", Server)
# What a completion request leaves for the metrics middleware (`build_app`).
ARRIVED = web.RequestKey("arrived", float)  # time.perf_counter() at its arrival
ANSWER = web.RequestKey("answer", object)  # its `Answer`
PROMPT_TOKENS = web.RequestKey("prompt_tokens", int)


def build_app(server: Server) -> web.Application:
    """The aiohttp application of ``server``: the endpoints of the module docstring."""
    app = web.Application(client_max_size=4 << 20, middlewares=[_observed])
    app[SERVER] = server
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/v1/completions", functools.partial(_complete, kind="completions"))
    app.router.add_post("/v1/chat/completions", functools.partial(_complete, kind="chat"))
    return app


@web.middleware
async def _observed(request: web.Request, handler):
    """Each completion request's status, latency and choices into the server's metrics."""
    if request.method != "POST":
        return await handler(request)
    request[ARRIVED] = start = time.perf_counter()
    response = await handler(request)
    request.app[SERVER].metrics.observe(
        request.path,
        response.status,
        time.perf_counter() - start,
        request.get(ANSWER),
        request.get(PROMPT_TOKENS, 0),
    )
    return response


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[SERVER].metrics.scrape()
    return web.Response(body=body, headers={"Content-Type": serve_metrics.CONTENT_TYPE})


async def _health(request: web.Request) -> web.Response:
    server = request.app[SERVER]
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


async def _models(request: web.Request) -> web.Response:
    model = {"id": request.app[SERVER].model_name, "object": "model"}
    model |= {"created": 0, "owned_by": "mars-jax"}
    return web.json_response({"object": "list", "data": [model]})


def _admit(server: Server, parsed: Parsed) -> None:
    """`RequestError` where the server cannot take ``parsed`` now: busy (429), or its engine
    failed (503)."""
    if server.engine.waiting + len(parsed.requests) > server.max_waiting:
        raise RequestError("the server is busy: too many requests wait for a slot", None, 429)
    if server.engine.dead.is_set():
        raise RequestError(f"the decoding engine failed: {server.engine.last_error}", None, 503)


async def _complete(request: web.Request, kind: str) -> web.StreamResponse:
    """``POST /v1/completions`` or ``/v1/chat/completions``: the answer, whole or streamed."""
    server = request.app[SERVER]
    if server.closing:
        return error_response("the server is shutting down", 503)
    try:
        parsed = server.parse(await request.read(), kind)
        _admit(server, parsed)
        request[PROMPT_TOKENS] = parsed.prompt_tokens
        pieces = server.choices(parsed)
        answer = request[ANSWER] = Answer(len(parsed.requests), request.get(ARRIVED))
        try:
            if parsed.streaming:
                return await _stream(request, server, parsed, pieces, answer)
            async for piece in pieces:
                answer.add(piece)
        finally:
            await pieces.aclose()  # a client gone mid-request frees its slots
        return web.json_response(server.answer_body(parsed, answer))
    except RequestError as e:
        return error_response(str(e), e.status, e.param)
    except InputError as e:  # e.g. a prompt with a token a trimmed run lacks
        return error_response(str(e), 400)


async def _stream(request, server: Server, parsed: Parsed, pieces, answer: Answer):
    """Server-sent events: one chunk per `Piece` (`Adapter.chunk_body`), ``usage`` in the chunk
    that ends the last choice, an error as the last event, then ``data: [DONE]``."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    state = StreamState.of(parsed)
    try:
        try:
            async for piece in pieces:
                answer.add(piece)
                body = server.chunk_body(parsed, piece, answer, state)
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
            self.port = self.runner.addresses[0][1]
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
