"""The OpenAI wire format of the server (`mars_jax.openai_protocol`), without a model: requests
read in strict mode with unknown fields refused, OpenAI's unimplemented fields accepted only at
their neutral values, every refusal a 400 whose ``param`` is the validation error's location,
and response bodies that the official `openai` client's own types read back."""

import json

import openai.types as oai
import openai.types.chat as oai_chat
import pytest
from pydantic import ValidationError

from mars_jax import openai_protocol as protocol
from mars_jax.openai_protocol import RequestError, parse_request

PROMPT = {"prompt": "hello"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def refused(kind: str, body) -> RequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestError) as caught:
        parse_request(kind, raw)
    assert caught.value.status == 400
    return caught.value


def accepted(kind: str, body):
    return parse_request(kind, json.dumps(body).encode())


def test_a_completion_prompt_takes_openais_four_forms():
    """A string, a list of ids, or a list of either (lm_eval's local-completions sends token ids
    in a list): ``prompts`` lists them."""
    assert accepted("completions", {"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert accepted("completions", {"prompt": [[7, 0]]}).prompts == [[7, 0]]
    assert accepted("completions", {"prompt": ["text"]}).prompts == ["text"]
    assert accepted("completions", {"prompt": "text"}).prompts == ["text"]
    assert accepted("completions", {"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert accepted("completions", {"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]


def test_a_completion_request_and_its_defaults():
    req = accepted("completions", PROMPT)
    assert req.prompts == ["hello"] and req.stops == [] and not req.streaming
    assert (req.model, req.temperature, req.seed, req.threshold) == (None, None, None, None)
    assert req.budget() == (None, "max_tokens")
    full = accepted(
        "completions",
        {
            "prompt": ["one prompt"],
            "model": "tiny",
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "temperature": 1,  # an integer is a number
            "seed": 2**32 - 1,
            "stop": "\n",
            "stream": True,
            "threshold": 1,
        },
    )
    assert full.prompts == ["one prompt"] and full.stops == ["\n"] and full.streaming
    assert full.budget() == (7, "max_completion_tokens")
    assert (full.temperature, full.seed, full.threshold) == (1.0, 2**32 - 1, 1.0)
    nulls = {k: None for k in ("model", "max_tokens", "temperature", "seed", "stop", "stream")}
    assert accepted("completions", {**PROMPT, **nulls}).budget() == (None, "max_tokens")


def test_a_chat_request_takes_string_and_text_part_contents():
    req = accepted(
        "chat",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": ""},
                {"role": "developer", "content": "use tools"},
                {"role": "assistant", "content": None},
            ],
            "stop": ["x", "yz"],
        },
    )
    # Text parts joined by newlines (vLLM's rule); developer rendered as system (OpenAI's
    # mapping); an assistant's null content read as empty.
    assert [(m.template_role, m.text) for m in req.messages] == [
        ("system", "be brief"),
        ("user", "a\nb"),
        ("assistant", ""),
        ("system", "use tools"),
        ("assistant", ""),
    ]
    assert req.stops == ["x", "yz"]


@pytest.mark.parametrize(
    "kind, body, param",
    [
        ("completions", {**PROMPT, "nonsense_field": 1}, "nonsense_field"),
        ("chat", {**CHAT, "prompt": "hi"}, "prompt"),
        ("completions", {**PROMPT, "messages": []}, "messages"),
        ("chat", {**CHAT, "tools": []}, "tools"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi", "weight": 1}]},
            "messages[0].weight",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
            "messages[0].content[0].x",
        ),
    ],
)
def test_an_unknown_field_is_refused_by_its_location(kind, body, param):
    error = refused(kind, body)
    assert error.param == param
    assert f"unknown field {param!r}" in str(error)


# (field, neutral values, other values): each neutral value accepted, each other one refused.
UNSUPPORTED = [
    ("best_of", [1], [2, True, 1.5]),
    ("frequency_penalty", [0, 0.0], [0.5, -1, False]),
    ("presence_penalty", [0, 0.0], [1.0, False]),
    ("echo", [False], [True, 0]),
    ("logit_bias", [{}], [{"50256": -100}, [], 0]),
    ("suffix", [], ["", "end"]),
    ("response_format", [{"type": "text"}], [{"type": "json_object"}, "text", {}]),
]


# The sampling fields the server implements: (kind, field, accepted values, refused values).
SAMPLING = [
    ("completions", "n", [1, 2, 128], [0, 129, True, 1.0, "1"]),
    ("chat", "n", [3], [0, False]),
    ("completions", "top_p", [1, 0.5, 1e-3], [0, 1.5, -0.1, True, "1"]),
    ("completions", "logprobs", [0, 5], [6, -1, True, 1.5]),
    ("chat", "logprobs", [True, False], [1, "true"]),
]


@pytest.mark.parametrize("kind, field, good, bad", SAMPLING)
def test_the_sampling_fields_are_read_in_their_ranges(kind, field, good, bad):
    base = PROMPT if kind == "completions" else CHAT
    for value in [None, *good]:
        assert getattr(accepted(kind, {**base, field: value}), field) == value
    for value in bad:
        assert refused(kind, {**base, field: value}).param == field


def test_top_logprobs_needs_logprobs_and_completions_count_alternatives_in_logprobs():
    assert accepted("chat", {**CHAT, "logprobs": True, "top_logprobs": 20}).alternatives == 20
    assert accepted("chat", {**CHAT, "logprobs": True}).alternatives == 0
    assert accepted("chat", {**CHAT, "logprobs": False}).alternatives is None
    for body in ({"top_logprobs": 2}, {"logprobs": False, "top_logprobs": 2}):
        error = refused("chat", {**CHAT, **body})
        assert error.param == "top_logprobs" and "needs logprobs" in str(error)
    assert refused("chat", {**CHAT, "logprobs": True, "top_logprobs": 21}).param == "top_logprobs"
    assert accepted("completions", {**PROMPT, "logprobs": 3}).alternatives == 3
    assert accepted("completions", PROMPT).alternatives is None
    assert refused("completions", {**PROMPT, "top_logprobs": 2}).param == "top_logprobs"


def test_the_table_covers_the_unsupported_fields():
    assert sorted(f for f, _, _ in UNSUPPORTED) == sorted(protocol.UNSUPPORTED)


@pytest.mark.parametrize("kind, base", [("completions", PROMPT), ("chat", CHAT)])
@pytest.mark.parametrize("field, neutral, other", UNSUPPORTED)
def test_an_unsupported_field_is_accepted_only_at_its_neutral_value(
    kind, base, field, neutral, other
):
    for value in [None, *neutral]:
        assert getattr(accepted(kind, {**base, field: value}), field) == value
    for value in other:
        error = refused(kind, {**base, field: value})
        assert error.param == field, value
        assert "not supported" in str(error) and str(error).startswith(f"{field}:")


def test_user_and_stream_options_are_accepted_and_ignored():
    accepted(
        "completions", {**PROMPT, "user": "someone", "stream_options": {"include_usage": True}}
    )
    accepted("chat", {**CHAT, "user": None, "stream_options": None})
    assert refused("chat", {**CHAT, "user": 5}).param == "user"


@pytest.mark.parametrize(
    "kind, body, param",
    [
        # Strict types: a boolean is not a number, a float not an integer, a string not either.
        ("completions", {**PROMPT, "max_tokens": True}, "max_tokens"),
        ("completions", {**PROMPT, "max_tokens": 2.0}, "max_tokens"),
        ("completions", {**PROMPT, "max_tokens": "3"}, "max_tokens"),
        ("chat", {**CHAT, "max_completion_tokens": False}, "max_completion_tokens"),
        ("completions", {**PROMPT, "temperature": True}, "temperature"),
        ("completions", {**PROMPT, "temperature": "0.5"}, "temperature"),
        ("completions", {**PROMPT, "seed": 1.5}, "seed"),
        ("completions", {**PROMPT, "threshold": False}, "threshold"),
        ("completions", {**PROMPT, "stream": "yes"}, "stream"),
        ("completions", {**PROMPT, "stream": 1}, "stream"),
        ("completions", {**PROMPT, "model": 3}, "model"),
        # Ranges.
        ("completions", {**PROMPT, "max_tokens": 0}, "max_tokens"),
        ("completions", {**PROMPT, "temperature": -0.5}, "temperature"),
        ("completions", {**PROMPT, "temperature": 2.01}, "temperature"),
        ("completions", {**PROMPT, "seed": -1}, "seed"),
        ("completions", {**PROMPT, "seed": 2**32}, "seed"),
        # Stop strings.
        ("completions", {**PROMPT, "stop": 7}, "stop"),
        ("completions", {**PROMPT, "stop": ""}, "stop"),
        ("completions", {**PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("completions", {**PROMPT, "stop": ["a", ""]}, "stop[1]"),
        ("completions", {**PROMPT, "stop": ["a", 3]}, "stop[1]"),
        # The prompt.
        ("completions", {}, "prompt"),
        ("completions", {"prompt": None}, "prompt"),
        ("completions", {"prompt": ""}, "prompt"),
        ("completions", {"prompt": ["a", ""]}, "prompt"),
        ("completions", {"prompt": [[1, 2], []]}, "prompt"),
        ("completions", {"prompt": ["a", [3]]}, "prompt"),  # one form per request
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"prompt": [[]]}, "prompt"),
        ("completions", {"prompt": [1, True]}, "prompt"),  # a boolean is not a token id
        ("completions", {"prompt": [1.0]}, "prompt"),
        # Messages, nested.
        ("chat", {}, "messages"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": "hi"}, "messages"),
        ("chat", {"messages": ["hi"]}, "messages[0]"),
        ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("chat", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ("chat", {"messages": [{"role": "user"}]}, "messages[0].content"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": {}}]},
            "messages[1].content",
        ),
        (
            "chat",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 3}],
                    }
                ]
            },
            "messages[0].content[1].text",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
        ),
    ],
)
def test_a_bad_field_is_a_400_naming_its_location(kind, body, param):
    error = refused(kind, body)
    assert error.param == param
    assert str(error).startswith(param), str(error)


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b'{"prompt": "a", "temperature": NaN}', "temperature"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"hello"', "must be a JSON object"),
        (b"null", "must be a JSON object"),
    ],
)
def test_a_body_that_is_not_a_json_object_names_no_field(raw, words):
    error = refused("completions", raw)
    assert words in str(error)
    assert error.param == ("temperature" if words == "temperature" else None)


def test_many_errors_are_listed_up_to_a_few_and_the_first_is_the_param():
    body = {"messages": [{"role": "user"}] * 100}
    error = refused("chat", body)
    assert error.param == "messages[0].content"
    assert str(error).count("is required") == protocol.MAX_LISTED
    assert str(error).endswith(f"and {100 - protocol.MAX_LISTED} more")


def test_request_error_of_a_validation_error_is_openais_error_body():
    with pytest.raises(ValidationError) as caught:
        protocol.CompletionRequest.model_validate_json(b'{"prompt": "a", "seed": true}')
    error = protocol.request_error(caught.value)
    assert error.status == 400
    assert error.body().model_dump() == {
        "error": {
            "message": "seed: Input should be a valid integer",
            "type": "invalid_request_error",
            "param": "seed",
            "code": None,
        }
    }


def test_param_of_a_location():
    assert protocol.param_of(()) is None
    assert protocol.param_of(("max_tokens",)) == "max_tokens"
    assert protocol.param_of(("messages", 1, "content")) == "messages[1].content"
    assert protocol.param_of(("messages", 0, "content", 2, "text")) == "messages[0].content[2].text"


def test_error_bodies_by_status():
    types = {s: protocol.ErrorResponse.of("m", s).error.type for s in (400, 404, 429, 503)}
    assert types == {
        400: "invalid_request_error",
        404: "not_found_error",
        429: "rate_limit_error",
        503: "server_error",
    }
    assert protocol.ErrorResponse.of("m", 404, "model").model_dump()["error"]["param"] == "model"


USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "tokens_per_forward": 2.0}


def test_response_bodies_are_what_the_openai_client_reads():
    completion = protocol.Completion(
        id="cmpl-1",
        created=1,
        model="tiny",
        choices=[protocol.CompletionChoice(text="hi", finish_reason="length")],
        usage=USAGE,
    ).model_dump()
    assert completion == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}],
        "usage": USAGE,
    }
    read = oai.Completion.model_validate(completion)
    assert read.choices[0].text == "hi" and read.usage.total_tokens == 7
    assert read.usage.model_extra == {"tokens_per_forward": 2.0}

    chat = protocol.ChatCompletion(
        id="chatcmpl-1",
        created=1,
        model="tiny",
        choices=[
            protocol.ChatChoice(message=protocol.ChatMessage(content="ok"), finish_reason="stop")
        ],
    ).model_dump()
    assert "usage" not in chat and chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    assert oai_chat.ChatCompletion.model_validate(chat).choices[0].message.content == "ok"

    def chunk(role, reason=None, usage=None):
        delta = protocol.ChatDelta(role=role, content="x")
        return protocol.ChatCompletionChunk(
            id="chatcmpl-1",
            created=1,
            model="tiny",
            choices=[protocol.ChatChunkChoice(delta=delta, finish_reason=reason)],
            usage=usage,
        ).model_dump()

    first, last = chunk("assistant"), chunk(None, "stop", USAGE)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "x"}
    assert last["choices"][0]["delta"] == {"content": "x"} and last["usage"] == USAGE
    assert "usage" not in first and first["object"] == "chat.completion.chunk"
    for body in (first, last):
        assert oai_chat.ChatCompletionChunk.model_validate(body).choices[0].delta.content == "x"


def test_an_assistant_message_as_the_openai_client_returns_it_is_read():
    """A message echoed back from the client's own types (``name``, and null ``refusal``,
    ``tool_calls``, ``function_call``, ``audio``) is read; a non-null tool call is refused."""
    echoed = {
        "role": "assistant",
        "content": "84",
        "name": "bot",
        "refusal": None,
        "tool_calls": None,
        "function_call": None,
        "audio": None,
    }
    body = {"messages": [{"role": "user", "content": "12 * 7?"}, echoed]}
    req = parse_request("chat", json.dumps(body))
    assert [m.text for m in req.messages] == ["12 * 7?", "84"]
    echoed["tool_calls"] = [{"id": "x", "type": "function"}]
    with pytest.raises(RequestError) as error:
        parse_request("chat", json.dumps(body))
    assert error.value.param == "messages[1].tool_calls"
