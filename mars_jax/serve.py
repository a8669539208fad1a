r"""An OpenAI-compatible HTTP server for a MARS run, on the continuous-batching `engine.Engine`.

  python -m mars_jax.serve --workdir=runs/mars --port=8000 [--host=127.0.0.1 --slots=8
      --threshold=0.95 --max_prompt_len=1024 --max_new_tokens=512 --max_waiting=64
      --prefill_chunk=256 --mesh=1,1,8]

Endpoints: ``POST /v1/completions`` (``prompt``: a string, tokenized as is) and ``POST
/v1/chat/completions`` (``messages`` rendered with the run's chat template), ``GET /v1/models``,
``GET /health``. Per request: ``max_tokens`` (default 16 for completions, the server's
``--max_new_tokens`` for chat), ``temperature`` (default 0: greedy; MARS accepts several
tokens per forward where it is confident), ``seed``, ``stop`` (a string or a list of up to 4),
``stream`` (server-sent events, ``data: [DONE]`` last), and the extra field ``threshold`` (in
(0, 1]; default ``--threshold``; 1.0 is exactly AR decoding). ``usage`` adds
``tokens_per_forward`` to OpenAI's token counts.

Errors are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad
request (the message names the field), 404 for an unknown path or model, 429 when
``--max_waiting`` requests already wait for a slot, 503 while shutting down. A client that
disconnects frees its slot. SIGTERM stops accepting requests, lets those in flight finish,
and exits 0. Built on aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from typing import Any, Sequence

from absl import flags, logging
from aiohttp import web

from mars_jax import cli, engine, sharding, sources
from mars_jax.errors import InputError

# Fields of OpenAI's requests that are accepted and ignored (at their neutral values).
_IGNORED = {
    "user",
    "logprobs",
    "top_logprobs",
    "echo",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "top_p",
    "best_of",
    "suffix",
    "stream_options",
    "response_format",
}
_COMMON = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "seed",
    "stop",
    "stream",
    "threshold",
    "n",
}
_FIELDS = {
    "completions": _COMMON | {"prompt"},
    "chat": _COMMON | {"messages"},
}
MAX_STOPS = 4


class RequestError(Exception):
    """A request refused with HTTP ``status`` (400 by default), naming its field ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_response(message: str, status: int, param: str | None = None) -> web.Response:
    """OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, with ``status``."""
    kind = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}
    return web.json_response(
        {
            "error": {
                "message": message,
                "type": kind.get(status, "server_error"),
                "param": param,
                "code": None,
            }
        },
        status=status,
    )


def _number(body: dict, key: str, default, kind=float, low=None, high=None, low_open=False):
    """``body[key]`` as ``kind`` (``default`` when absent or null), checked to be a number (an
    integer for ``kind=int``; never a boolean) in [low, high] ((low, high] with ``low_open``);
    RequestError naming ``key`` otherwise."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise RequestError(f"{key} must be {'a number' if kind is float else 'an integer'}", key)
    if (low is not None and (value <= low if low_open else value < low)) or (
        high is not None and value > high
    ):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(f"{key}={value!r} must lie in {bounds}", key)
    return kind(value)


class Server:
    """The request handling of `build_app`: parsing, prompt ids, and the text of each stream."""

    def __init__(
        self, eng: engine.Engine, tok, *, model_name: str, threshold: float, max_waiting: int
    ):
        self.engine, self.tok, self.model_name = eng, tok, model_name
        self.threshold, self.max_waiting = threshold, max_waiting
        self.closing = False

    # -- parsing ----------------------------------------------------------------------------------
    def parse(self, body: Any, kind: str) -> tuple[list[int], engine.Request, list[str], bool]:
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        unknown = sorted(set(body) - _FIELDS[kind] - _IGNORED)
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r}", unknown[0])
        if body.get("model") not in (None, self.model_name):
            raise RequestError(
                f"model {body['model']!r} is not served here (this server: {self.model_name!r})",
                "model",
                404,
            )
        if body.get("n") not in (None, 1):
            raise RequestError("n must be 1", "n")
        if not isinstance(body.get("stream", False), bool):
            raise RequestError("stream must be a boolean", "stream")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if (
            not isinstance(stops, list)
            or not all(isinstance(s, str) and s for s in stops)
            or (len(stops) > MAX_STOPS)
        ):
            raise RequestError(
                f"stop must be a non-empty string or a list of up to {MAX_STOPS}", "stop"
            )
        limit = self.engine.max_prompt_len
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if not isinstance(prompt, str) or not prompt:
                raise RequestError("prompt must be a non-empty string", "prompt")
            self._check_length(prompt, "prompt")
            ids = self.tok.encode(prompt)
        else:
            ids = self.tok.apply_chat_template(
                self._messages(body.get("messages")), add_generation_prompt=True
            )
        if len(ids) > limit:
            raise RequestError(
                f"the prompt is {len(ids)} tokens; this server takes at most {limit}",
                "prompt" if kind == "completions" else "messages",
            )
        default_max = 16 if kind == "completions" else self.engine.max_new_tokens
        key = (
            "max_completion_tokens"
            if body.get("max_completion_tokens") is not None
            else ("max_tokens")
        )
        max_tokens = _number(body, key, default_max, int, 1, self.engine.max_new_tokens)
        request = engine.Request(
            tuple(ids),
            max_tokens,
            threshold=_number(body, "threshold", self.threshold, float, 0, 1, low_open=True),
            temperature=_number(body, "temperature", 0.0, float, 0, 2),
            seed=_number(body, "seed", 0, int, 0, 2**32 - 1),
        )
        return ids, request, stops, body.get("stream", False)

    def _check_length(self, text: str, param: str) -> None:
        # Far beyond any prompt that fits (a token is rarely under 1 character): refused unread.
        if len(text) > 64 * self.engine.max_prompt_len:
            raise RequestError(
                f"{param} is {len(text)} characters; too long for this server", param
            )

    def _messages(self, messages) -> list[dict]:
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", "messages")
        out = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise RequestError(f"{where}.role must be system, user or assistant", where)
            content = m.get("content")
            if isinstance(content, list):  # OpenAI's content parts: text only
                if not all(
                    isinstance(p, dict)
                    and p.get("type") == "text"
                    and isinstance(p.get("text"), str)
                    for p in content
                ):
                    raise RequestError(f"{where}.content: only text parts are supported", where)
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise RequestError(f"{where}.content must be a string", where)
            self._check_length(content, f"{where}.content")
            out.append({"role": m["role"], "content": content})
        return out

    # -- decoding ---------------------------------------------------------------------------------
    async def decode(self, ids, request: engine.Request, stops: list[str]):
        """Yields (text delta, finish_reason or None, usage or None) as tokens are committed."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        stream = self.engine.submit(
            request, lambda u: loop.call_soon_threadsafe(updates.put_nowait, u)
        )
        tokens, shown = [], ""
        hold = max((len(s) for s in stops), default=1) - 1
        try:
            while True:
                update = await updates.get()
                tokens += update.tokens
                text = self.tok.decode(tokens)
                reason = update.finish_reason
                cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    text, reason = text[:cut], "stop"
                    stream.cancel()
                elif not update.done:
                    text = text[: max(len(shown), len(text) - hold)]
                    if text.endswith("\ufffd"):  # a character still incomplete
                        text = text.rstrip("\ufffd")
                usage = None
                if reason is not None:
                    usage = {
                        "prompt_tokens": len(ids),
                        "completion_tokens": len(tokens),
                        "total_tokens": len(ids) + len(tokens),
                        "tokens_per_forward": len(tokens) / max(update.forwards, 1),
                    }
                    reason = "length" if reason == "length" else "stop"
                if len(text) > len(shown) or reason is not None:
                    yield text[len(shown) :], reason, usage
                    shown = text
                if reason is not None:
                    return
        finally:
            stream.cancel()  # the client went away, or the request ended: free the slot


def build_app(server: Server) -> web.Application:
    """The aiohttp application of ``server``: the endpoints of the module docstring."""
    app = web.Application(client_max_size=4 << 20)

    async def health(_):
        return web.json_response(
            {
                "status": "closing" if server.closing else "ok",
                "active": server.engine.active,
                "waiting": server.engine.waiting,
            }
        )

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
                try:
                    body = json.loads(await request.read())
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise RequestError(f"the body is not valid JSON ({e})") from None
                ids, req, stops, streaming = server.parse(body, kind)
                try:
                    server.engine.check(req)
                except InputError as e:
                    raise RequestError(str(e), getattr(e, "field", None)) from None
                if server.engine.waiting >= server.max_waiting:
                    raise RequestError(
                        "the server is busy: too many requests wait for a slot", None, 429
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
    rid = ("cmpl-" if kind == "completions" else "chatcmpl-") + uuid.uuid4().hex[:24]
    if kind == "completions":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    elif delta:
        content = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": content, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": reason,
        }
        obj = "chat.completion"
    body = {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        body["usage"] = usage
    return body


async def _stream(request, kind, server, chunks) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    first = True
    try:
        async for delta, reason, usage in chunks:
            body = _body(kind, server.model_name, delta, reason, usage, delta=True, first=first)
            first = False
            await response.write(f"data: {json.dumps(body)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
    except ConnectionResetError:  # the client went away: the caller frees the slot
        pass
    return response


class Background:
    """``app`` served on ``host``:``port`` by an event loop in a daemon thread (for tests and the
    load benchmark; the command line uses aiohttp's ``run_app``). `close` stops it."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0):
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app, access_log=None)
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


def make_server(
    workdir: str,
    *,
    slots: int,
    max_prompt_len: int,
    max_new_tokens: int,
    threshold: float,
    max_waiting: int,
    steps_per_call: int = 4,
    prefill_chunk: int | None = None,
    mesh_shape: Sequence[int] | None = None,
    block_size: int | None = None,
    model_name: str | None = None,
) -> Server:
    """The `Server` of the run (its latest checkpoint) or Hugging Face directory in
    ``workdir`` (`mars_jax.sources`), its engine started.
    ``mesh_shape``: (data, fsdp, tensor) sizes of the devices' mesh (-1 takes the rest); the
    parameters and the slots are sharded by the run's rules (None: one device's decoder)."""
    mesh = rules = None
    if mesh_shape is not None:
        mesh = sharding.make_mesh(*mesh_shape)
        rows = mesh.shape["data"] * mesh.shape["fsdp"]
        if slots % rows:
            raise InputError(f"slots: {slots}; must be a multiple of data x fsdp = {rows}")
        rules = sources.sharding_rules(workdir)
    opened = sources.open(workdir, block_size=block_size, mesh=mesh)
    model, tok = opened.model, opened.tokenizer
    eng = engine.Engine(
        model,
        slots=slots,
        max_prompt_len=max_prompt_len,
        max_new_tokens=max_new_tokens,
        block_size=opened.block_size,
        **opened.decode_ids(),
        steps_per_call=steps_per_call,
        prefill_chunk=prefill_chunk,
        mesh=mesh,
        axis_rules=rules,
    )
    eng.start()
    name = model_name or os.path.basename(os.path.normpath(workdir))
    return Server(eng, tok, model_name=name, threshold=threshold, max_waiting=max_waiting)


def main() -> None:
    workdir = cli.workdir_flag(
        "The run (its latest checkpoint) or Hugging Face directory to serve."
    )
    block_size = flags.DEFINE_integer(
        "block_size", None, "Block size (default: the run's, or config.json's mars_block_size)."
    )
    host = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
    port = flags.DEFINE_integer("port", 8000, "Port to listen on.")
    slots = flags.DEFINE_integer("slots", 8, "Requests decoded together.")
    threshold = flags.DEFINE_float("threshold", 0.95, "Default threshold of a request.")
    max_prompt = flags.DEFINE_integer("max_prompt_len", 1024, "Longest prompt, in tokens.")
    max_new = flags.DEFINE_integer("max_new_tokens", 512, "Largest max_tokens of a request.")
    max_waiting = flags.DEFINE_integer("max_waiting", 64, "Requests waiting for a slot (429).")
    steps = flags.DEFINE_integer("steps_per_call", 4, "Forwards per device call.")
    chunk = flags.DEFINE_integer("prefill_chunk", 256, "Prompt tokens per prefill forward.")
    mesh = flags.DEFINE_list(
        "mesh", None, "data,fsdp,tensor sizes of a mesh over this host's devices (e.g. 1,1,8)."
    )
    name = flags.DEFINE_string("model_name", None, "Model id (default: the workdir's name).")

    def run():
        server = make_server(
            workdir.value,
            slots=slots.value,
            max_prompt_len=max_prompt.value,
            max_new_tokens=max_new.value,
            threshold=threshold.value,
            max_waiting=max_waiting.value,
            steps_per_call=steps.value,
            prefill_chunk=chunk.value,
            mesh_shape=None if mesh.value is None else [int(n) for n in mesh.value],
            block_size=block_size.value,
            model_name=name.value,
        )
        app = build_app(server)

        async def closing(_):
            server.closing = True

        app.on_shutdown.append(closing)
        logging.info("serving %s on http://%s:%d", server.model_name, host.value, port.value)
        web.run_app(app, host=host.value, port=port.value, print=None, shutdown_timeout=60)
        server.engine.stop()

    cli.run(run)


if __name__ == "__main__":
    main()
