"""The OpenAI wire format of `mars_jax.serve`: typed request, response and error models.

Requests (`CompletionRequest` for ``/v1/completions``, `ChatCompletionRequest` for
``/v1/chat/completions``) are read from the raw body by `parse_request`, in pydantic's strict
mode: a boolean is not a number, a float is not an integer, a number is not a string. An
unknown field is refused. Fields of OpenAI's API that the server does not implement
(`UNSUPPORTED`: ``best_of``, ``echo``, ``logit_bias``, ...) are accepted only at their neutral value
(or null), and refused at any other. ``user`` (any string) and ``stream_options`` (anything) are
accepted and ignored.

Every refusal is a `RequestError` naming its field as OpenAI's ``param``: `request_error` turns
a pydantic ``ValidationError`` into one, with the field taken from the error's location
(``max_tokens``, ``messages[1].content``, ``stop[0]``), never from its text. The checks that
need the engine (prompt length, the largest ``max_tokens``, the model name) are the server's.

Responses: `Completion` (also each streamed chunk of a completion), `ChatCompletion`,
`ChatCompletionChunk`, with `Usage` (OpenAI's counts and ``tokens_per_forward``), and
`ErrorResponse`. ``model_dump()`` of each is the JSON body.

A leaf module: it imports nothing of mars-jax.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
)
from pydantic_core import PydanticCustomError

MAX_STOPS = 4
MAX_SEED = 2**32 - 1
MAX_N = 128  # choices per request (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' ``logprobs`` (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # /v1/chat/completions' ``top_logprobs`` (OpenAI's limit)


# -- errors -------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail

    @classmethod
    def of(cls, message: str, status: int, param: str | None = None) -> ErrorResponse:
        """The body of an error with HTTP ``status`` (its ``type`` follows from it)."""
        kind = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}
        return cls(
            error=ErrorDetail(
                message=message, type=kind.get(status, "server_error"), param=param, code=None
            )
        )


class RequestError(Exception):
    """A request refused with HTTP ``status`` (400 by default), naming its field ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> ErrorResponse:
        return ErrorResponse.of(str(self), self.status, self.param)


def param_of(loc: tuple[str | int, ...]) -> str | None:
    """A validation error's location as OpenAI's ``param``: ``("messages", 1, "content")`` is
    ``messages[1].content``; the body itself (``()``) is None."""
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    return param or None


MAX_LISTED = 3  # errors named in one message (a hostile body may hold thousands)


def request_error(error: ValidationError) -> RequestError:
    """The 400 of a request whose body failed validation: ``param`` is the location of its
    first error, and the message names each error's field (up to `MAX_LISTED`)."""
    errors = error.errors(include_url=False, include_input=False)
    lines = []
    for e in errors[:MAX_LISTED]:
        param, kind = param_of(e["loc"]), e["type"]
        if kind == "json_invalid":
            reason = e.get("ctx", {}).get("error", e["msg"])
            lines.append(f"the body is not valid JSON ({reason})")
        elif kind in ("model_type", "model_attributes_type", "dict_type") and param is None:
            lines.append("the body must be a JSON object")
        elif kind == "extra_forbidden":
            lines.append(f"unknown field {param!r}")
        elif kind == "missing":
            lines.append(f"{param} is required")
        elif param is None:
            lines.append(e["msg"])
        else:
            lines.append(f"{param}: {e['msg']}")
    if len(errors) > MAX_LISTED:
        lines.append(f"and {len(errors) - MAX_LISTED} more")
    return RequestError("; ".join(lines), param_of(errors[0]["loc"]) if errors else None)


# -- requests -----------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _number(value: Any, neutral: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == neutral


def _integer(value: Any, neutral: int) -> bool:
    return type(value) is int and value == neutral


# The fields of OpenAI's requests this server does not implement: (accepted value, its wording).
# null is accepted for each; any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: _integer(v, 1), "1"),
    "frequency_penalty": (lambda v: _number(v, 0), "0"),
    "presence_penalty": (lambda v: _number(v, 0), "0"),
    "echo": (lambda v: v is False, "false"),
    "logit_bias": (lambda v: v == {} and isinstance(v, dict), "{}"),
    "suffix": (lambda v: False, "null"),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}'),
}


def _listed(value: Any, one: Callable[[str], Any], error: PydanticCustomError) -> Any:
    """A list as given; a string as the list of ``one(string)``; anything else ``error``."""
    if isinstance(value, str):
        return [one(value)]
    if isinstance(value, list):
        return value
    raise error


def _stop(text: str) -> str:
    if not text:
        raise PydanticCustomError("stop_empty", "a stop string must not be empty")
    return text


class TextPart(_Strict):
    """One part of a message's content: only text parts are taken."""

    type: Literal["text"]
    text: str


class Message(_Strict):
    """A chat message. Its content is a string or a list of text parts (read as one list; null
    for an assistant's, read as empty). ``developer`` (what OpenAI's SDK sends for newer
    models) is rendered as ``system``, OpenAI's own mapping for models without that role."""

    role: Literal["system", "developer", "user", "assistant"]
    content: list[TextPart]
    name: str | None = None  # OpenAI's participant name: accepted, not rendered
    # What an OpenAI client sends back with an assistant message it received: only as null.
    refusal: None = None
    tool_calls: None = None
    function_call: None = None
    audio: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("role") == "assistant":
            return []
        error = PydanticCustomError("content_type", "must be a string or a list of text parts")
        return _listed(value, lambda text: {"type": "text", "text": text}, error)

    @property
    def text(self) -> str:
        """The content's text parts joined by newlines (as vLLM joins them)."""
        return "\n".join(p.text for p in self.content)

    @property
    def template_role(self) -> str:
        """The role the chat template is given."""
        return "system" if self.role == "developer" else self.role


# The fields of `UNSUPPORTED`, each any value (None when absent), checked by `_Request`.
_Unsupported = create_model(
    "_Unsupported", __base__=_Strict, **{f: (Any, None) for f in UNSUPPORTED}
)


class _Request(_Unsupported):
    """The fields both endpoints take."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_STOPS)
    stream: bool | None = None
    threshold: float | None = None  # MARS's own field; its range: DecodeOptions (the engine)
    # Accepted and ignored: any string, anything.
    user: str | None = None
    stream_options: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> Any:
        if value is None:
            return value
        error = PydanticCustomError(
            "stop_type", "must be a string or a list of up to {n} strings", {"n": MAX_STOPS}
        )
        return _listed(value, _stop, error)

    @field_validator(*UNSUPPORTED, mode="after")
    @classmethod
    def _neutral(cls, value: Any, info: ValidationInfo) -> Any:
        accepted, wording = UNSUPPORTED[info.field_name]
        if value is not None and not accepted(value):
            raise PydanticCustomError(
                "unsupported_value",
                "not supported by this server (only {neutral} or null is accepted)",
                {"neutral": wording},
            )
        return value

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def choices(self) -> int:
        return self.n or 1

    def budget(self) -> tuple[int | None, str]:
        """(new tokens asked for, the field that asked): ``max_completion_tokens`` before
        ``max_tokens``; None when neither is given."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(_Request):
    """A ``/v1/completions`` request: ``prompt`` is one prompt (a non-empty string or a non-empty
    list of token ids) or a non-empty list of them (OpenAI's four forms; lm_eval's
    ``local-completions`` sends token ids in a list); each prompt gets ``n`` choices, indexed
    prompt by prompt. ``logprobs`` k: each token's log-probability and its k most likely
    alternatives."""

    prompt: str | list[int] | list[str] | list[list[int]]  # checked whole by _prompts
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    top_logprobs: None = None  # chat's field: only null (the count is ``logprobs`` here)

    @property
    def alternatives(self) -> int | None:
        """Most likely alternatives asked for per token (None: no log-probabilities)."""
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        one = isinstance(self.prompt, str) or all(type(v) is int for v in self.prompt)
        return [self.prompt] if one else list(self.prompt)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        def text(v):
            return isinstance(v, str) and v

        def ids(v):
            return isinstance(v, list) and v and all(type(t) is int for t in v)

        many = isinstance(value, list) and value
        if text(value) or ids(value):
            return value
        if many and (all(text(v) for v in value) or all(ids(v) for v in value)):
            return value
        raise PydanticCustomError(
            "prompt_type",
            "a prompt (a non-empty string or list of token ids) or a non-empty list of them",
        )


class ChatCompletionRequest(_Request):
    """A ``/v1/chat/completions`` request: a non-empty list of messages; ``logprobs`` true
    asks for each token's log-probability, with ``top_logprobs`` alternatives."""

    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs", mode="after")
    @classmethod
    def _with_logprobs(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("top_logprobs", "needs logprobs set to true")
        return value

    @property
    def alternatives(self) -> int | None:
        """Most likely alternatives asked for per token (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None


REQUESTS: dict[str, type[_Request]] = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
}


def parse_request(kind: str, raw: bytes | str) -> CompletionRequest | ChatCompletionRequest:
    """The request of endpoint ``kind`` (a key of `REQUESTS`) in the JSON body ``raw``;
    `RequestError` (400, naming the field) if it is not one."""
    try:
        return REQUESTS[kind].model_validate_json(raw)
    except ValidationError as e:
        raise request_error(e) from None


# -- responses ----------------------------------------------------------------------------------
class _Body(BaseModel):
    """A response body: its fields named in ``omitted_when_none`` are left out while None (the
    others are written as null)."""

    omitted_when_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, write):
        data = write(self)
        for name in self.omitted_when_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


class Usage(BaseModel):
    """OpenAI's token counts, and the tokens committed per forward of the request's rows."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    tokens_per_forward: float


class _Answer(_Body):
    """What every answer carries; ``object`` and ``choices`` are each kind's own."""

    omitted_when_none = ("usage",)

    id: str
    created: int
    model: str
    usage: Usage | None = None


class _Choice(BaseModel):
    """What every choice carries; its text (``text``, ``message`` or ``delta``) is each kind's."""

    index: int = 0
    finish_reason: str | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy log-probabilities of a completion: per token its text, log-probability,
    most likely alternatives ({text: log-probability}) and offset in the completion's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    """One token of a chat answer's log-probabilities, with its most likely alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class Completion(_Answer):
    """A ``/v1/completions`` answer, and each chunk of a streamed one (``usage`` in the last)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: ChatMessage
    logprobs: ChatLogprobs | None = None


class ChatDelta(_Body):
    """The text of one chunk; the first chunk also names the role."""

    omitted_when_none = ("role",)
    role: Literal["assistant"] | None = None
    content: str


class ChatChunkChoice(_Choice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None


class ChatCompletion(_Answer):
    """A ``/v1/chat/completions`` answer."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Answer):
    """One server-sent event of a streamed ``/v1/chat/completions`` answer (``usage`` in the
    last)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
