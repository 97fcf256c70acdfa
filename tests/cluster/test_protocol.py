"""The OpenAI request/response models and the error mapping, without HTTP.

Every refusal is checked through :func:`ferrox.cluster.errors.validation_error`,
the same path the HTTP layer takes, so the asserted ``param`` / ``code`` are
what a client sees.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import ValidationError
from ray.exceptions import ActorDiedError, RayTaskError, TaskCancelledError
from ray.serve.exceptions import RequestCancelledError

from ferrox.cluster.errors import OpenAIError, error_body, is_cancellation, param_path, printable, validation_error
from ferrox.cluster.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
    chunk_dict,
    lone_surrogate,
)
from ferrox.replicas.types import SamplingParams

USER_HI = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER_HI, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hello", **fields})


def refusal(model: type, data: dict[str, Any]) -> OpenAIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return validation_error(info.value.errors(include_url=False))


def chat_refusal(**fields: Any) -> OpenAIError:
    return refusal(ChatCompletionRequest, {"model": "m", "messages": USER_HI, **fields})


def completion_refusal(**fields: Any) -> OpenAIError:
    return refusal(CompletionRequest, {"model": "m", "prompt": "Hello", **fields})


# ---------------------------------------------------------------- sampling params


def test_an_empty_chat_request_takes_openai_defaults_and_the_given_budget():
    assert chat().to_sampling_params(37) == SamplingParams(
        max_tokens=37,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        seed=None,
        stop=(),
        stop_token_ids=(),
        ignore_eos=False,
    )


def test_every_sampling_field_reaches_the_engine_params():
    request = chat(
        max_tokens=9,
        temperature=0.0,
        top_p=0.5,
        seed=7,
        stop=["\n\n", "END"],
        presence_penalty=-1.5,
        frequency_penalty=2.0,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        ignore_eos=True,
        stop_token_ids=[2, 0],
    )
    assert request.to_sampling_params(100) == SamplingParams(
        max_tokens=9,
        temperature=0.0,
        top_p=0.5,
        top_k=40,
        min_p=0.05,
        presence_penalty=-1.5,
        frequency_penalty=2.0,
        repetition_penalty=1.1,
        seed=7,
        stop=("\n\n", "END"),
        stop_token_ids=(2, 0),
        ignore_eos=True,
    )


def test_max_completion_tokens_wins_over_max_tokens():
    request = chat(max_tokens=50, max_completion_tokens=5)
    assert request.requested_max_tokens == 5
    assert request.max_tokens_param == "max_completion_tokens"
    assert request.to_sampling_params(100).max_tokens == 5


def test_max_tokens_alone_is_the_chat_budget():
    request = chat(max_tokens=50)
    assert (request.requested_max_tokens, request.max_tokens_param) == (50, "max_tokens")


def test_a_single_stop_string_becomes_a_one_element_tuple():
    assert completion(stop="###").to_sampling_params(4).stop == ("###",)


def test_sixteen_stop_strings_are_accepted_and_seventeen_refused():
    assert len(completion(stop=[f"s{i}" for i in range(16)]).to_sampling_params(4).stop) == 16
    error = completion_refusal(stop=[f"s{i}" for i in range(17)])
    assert (error.status_code, error.param) == (400, "stop")
    assert error.message == "'stop' may hold at most 16 strings, got 17"


def test_an_empty_stop_string_is_refused():
    assert completion_refusal(stop=["ok", ""]).param == "stop"


def test_a_stop_that_is_neither_string_nor_list_is_refused_naming_stop():
    error = completion_refusal(stop=5)
    assert (error.param, error.message) == ("stop", "'stop' must be a string or a list of strings")


# ---------------------------------------------------------------- chat messages


def test_text_parts_are_joined_by_newlines_for_the_template():
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok"},
            ],
        }
    )
    assert request.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
    ]


def test_an_image_part_is_refused_at_its_message_content():
    error = refusal(
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    )
    assert (error.param, error.code) == ("messages.0.content", "invalid_value")
    assert error.message == (
        "Invalid value for 'messages.0.content': only content parts of type 'text' are supported, got 'image_url'"
    )


def test_a_developer_message_reaches_the_template_as_a_system_message():
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    )
    assert request.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_a_tool_role_is_refused_at_its_role():
    error = refusal(ChatCompletionRequest, {"model": "m", "messages": [{"role": "tool", "content": "x"}]})
    assert error.param == "messages.0.role"


def test_missing_messages_name_messages():
    error = refusal(ChatCompletionRequest, {"model": "m"})
    assert (error.status_code, error.param, error.code) == (400, "messages", "missing_required_parameter")
    assert error.message == "Missing required parameter: 'messages'"


def test_an_empty_message_list_is_refused_naming_messages():
    assert refusal(ChatCompletionRequest, {"model": "m", "messages": []}).param == "messages"


def test_model_is_required():
    assert refusal(ChatCompletionRequest, {"messages": USER_HI}).param == "model"


# ---------------------------------------------------------------- ranges and types


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("temperature", 3),
        ("temperature", -0.1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("max_tokens", 0),
        ("max_completion_tokens", 0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("seed", 2**64),
        ("stream", "maybe"),
    ],
)
def test_a_bad_value_is_a_400_naming_its_field(field: str, value: Any):
    error = chat_refusal(**{field: value})
    assert (error.status_code, error.type, error.param) == (400, "invalid_request_error", field)


def test_a_wrong_type_has_code_invalid_type_and_echoes_the_value():
    error = chat_refusal(temperature="hot")
    assert error.code == "invalid_type"
    assert error.message == """Invalid value for 'temperature': Input should be a valid number (got "hot")"""


def test_an_out_of_range_value_has_code_invalid_value():
    error = chat_refusal(temperature=3)
    assert error.code == "invalid_value"
    assert error.message == "Invalid value for 'temperature': Input should be less than or equal to 2 (got 3)"


def test_stream_options_without_stream_is_refused():
    error = chat_refusal(stream_options={"include_usage": True})
    assert (error.param, error.message) == ("stream_options", "'stream_options' is only allowed when 'stream' is true")


def test_include_usage_needs_stream_and_the_flag():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage is True
    assert chat(stream=True, stream_options={"include_usage": False}).include_usage is False
    assert chat(stream=True).include_usage is False


def test_several_bad_fields_are_all_named():
    error = chat_refusal(temperature=9, top_p=9)
    assert error.param == "temperature"
    assert error.message.endswith("; also invalid: 'top_p'")


# ---------------------------------------------------------------- unsupported features


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 2),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("logprobs", True),
        ("top_logprobs", 3),
        ("response_format", {"type": "json_object"}),
        ("logit_bias", {"50256": -100}),
    ],
)
def test_an_unsupported_chat_feature_is_a_400_naming_it(field: str, value: Any):
    error = chat_refusal(**{field: value})
    assert (error.status_code, error.param, error.code) == (400, field, "unsupported_parameter")
    assert error.message.startswith(f"'{field}' is not supported by this server: ")


@pytest.mark.parametrize(
    ("field", "value"),
    [("n", 3), ("echo", True), ("logprobs", 0), ("best_of", 2), ("suffix", "tail"), ("logit_bias", {"1": 5})],
)
def test_an_unsupported_completion_feature_is_a_400_naming_it(field: str, value: Any):
    error = completion_refusal(**{field: value})
    assert (error.status_code, error.param, error.code) == (400, field, "unsupported_parameter")


def test_the_off_values_of_unsupported_features_are_accepted():
    request = chat(
        n=1,
        tools=[],
        tool_choice="none",
        logprobs=False,
        top_logprobs=0,
        response_format={"type": "text"},
        logit_bias={},
        parallel_tool_calls=False,
    )
    assert request.to_sampling_params(3).max_tokens == 3
    assert completion(n=1, echo=False, best_of=1, suffix="").to_sampling_params(3).max_tokens == 3


def test_unknown_fields_are_ignored():
    request = chat(store=False, metadata={"a": "b"}, service_level="x", user="u-1")
    assert request.user == "u-1"
    assert not hasattr(request, "store")


# ---------------------------------------------------------------- completion prompts


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("Hi", "Hi"), ([5, 6], [5, 6]), (["Hi"], "Hi"), ([[5, 6]], [5, 6]), ("", ""), ([], [])],
)
def test_a_prompt_is_a_string_or_token_ids_possibly_wrapped_once(prompt: Any, expected: Any):
    assert completion(prompt=prompt).prompt == expected


def test_a_batch_of_prompts_is_refused_naming_prompt():
    error = completion_refusal(prompt=["a", "b"])
    assert (error.param, error.code) == ("prompt", "unsupported_parameter")
    assert error.message == "'prompt' is not supported by this server: one prompt per request, got a batch of 2"


@pytest.mark.parametrize("prompt", [7, [1, "a"], [["a"]], [1.5], [True], None])
def test_a_malformed_prompt_is_refused_naming_prompt(prompt: Any):
    error = completion_refusal(prompt=prompt)
    assert (error.param, error.code) == ("prompt", "invalid_type")


# ---------------------------------------------------------------- responses and errors


def test_usage_totals_and_carries_cached_tokens():
    assert UsageInfo.of(10, 4, cached_tokens=8).model_dump() == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_a_chat_chunk_omits_unset_delta_fields_and_usage_unless_asked():
    chunk = ChatCompletionChunk(
        id="chatcmpl-1", created=5, model="m", choices=[ChatChunkChoice(delta=DeltaMessage(), finish_reason="stop")]
    )
    assert chunk_dict(chunk, include_usage=False) == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
    }
    assert chunk_dict(chunk, include_usage=True)["usage"] is None


def test_a_completion_chunk_keeps_its_text_and_null_finish_reason():
    chunk = CompletionResponse(id="cmpl-1", created=5, model="m", choices=[CompletionChoice(text="ab")])
    assert chunk_dict(chunk, include_usage=False) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 5,
        "model": "m",
        "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}],
    }


def test_a_model_list_has_openai_shape():
    assert ModelList(data=[ModelCard(id="m", created=1, max_model_len=8)]).model_dump() == {
        "object": "list",
        "data": [{"id": "m", "object": "model", "created": 1, "owned_by": "ferrox", "max_model_len": 8}],
    }


def test_an_error_body_has_exactly_the_four_openai_keys():
    assert error_body("boom", "server_error") == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": None}
    }


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (404, "not_found_error"), (429, "rate_limit_error"),
     (500, "server_error"), (503, "overloaded_error"), (504, "server_error")],
)
def test_an_openai_error_takes_the_conventional_type_for_its_status(status: int, kind: str):
    error = OpenAIError(status, "m", headers={"Retry-After": "2"})
    assert (error.type, error.headers) == (kind, {"Retry-After": "2"})
    assert error.body() == {"error": {"message": "m", "type": kind, "param": None, "code": None}}


@pytest.mark.parametrize(
    ("loc", "path"),
    [
        (("body", "messages", 0, "content"), "messages.0.content"),
        (("body", "prompt", "list[int]", 3), "prompt.3"),
        (("body", "stop", "str"), "stop"),
        (("body", "x", "function-after[_v(), str]"), "x"),
        (("body",), None),
        ((), None),
    ],
)
def test_param_paths_drop_the_body_prefix_and_union_tags(loc: tuple, path: str | None):
    assert param_path(loc) == path


def test_a_fastapi_json_decode_error_becomes_invalid_json_without_param():
    error = validation_error(
        [{"type": "json_invalid", "loc": ("body", 9), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}]
    )
    assert (error.status_code, error.param, error.code) == (400, None, "invalid_json")
    assert error.message == "We could not parse the JSON body of your request: Expecting value"


# ---------------------------------------------------------------- strict types


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("max_tokens", "4", "integer"),
        ("max_tokens", True, "integer"),
        ("max_tokens", 4.0, "integer"),
        ("max_completion_tokens", "4", "integer"),
        ("seed", "5", "integer"),
        ("top_k", 1.5, "integer"),
        ("n", "1", "integer"),
        ("stop_token_ids", [True], "integer"),
        ("stream", "yes", "boolean"),
        ("stream", 1, "boolean"),
        ("ignore_eos", "true", "boolean"),
        ("logprobs", 0, "boolean"),
        ("temperature", True, "number"),
        ("temperature", "0.5", "number"),
        ("user", 5, "string"),
        ("model", 5, "string"),
    ],
)
def test_a_value_of_the_wrong_json_type_is_refused_not_coerced(field: str, value: Any, kind: str):
    error = chat_refusal(**{field: value})
    assert (error.status_code, error.code) == (400, "invalid_type")
    assert error.param in (field, f"{field}.0")
    assert error.message.startswith(f"Invalid value for '{error.param}': Input should be a valid {kind}")


def test_a_string_include_usage_is_refused_at_its_path():
    error = chat_refusal(stream=True, stream_options={"include_usage": "yes"})
    assert (error.param, error.code) == ("stream_options.include_usage", "invalid_type")


def test_a_string_echo_is_refused_for_completions():
    assert completion_refusal(echo="false").param == "echo"


def test_integers_are_accepted_for_number_fields():
    params = chat(temperature=1, top_p=1, presence_penalty=-2, frequency_penalty=2, min_p=0,
                  repetition_penalty=2).to_sampling_params(8)
    assert (params.temperature, params.top_p, params.min_p, params.repetition_penalty) == (1.0, 1.0, 0.0, 2.0)
    assert (params.presence_penalty, params.frequency_penalty) == (-2.0, 2.0)


# ---------------------------------------------------------------- strings that are not valid Unicode


@pytest.mark.parametrize(
    ("data", "found"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}, ("messages.0.content", False)),
        ({"model": "a\udfffb"}, ("model", False)),
        ({"stop": ["ok", "\udc00"], "user": "\ud800"}, ("stop.1", False)),
        ({"metadata": {"x": {"\ud800": 1}}}, ("metadata.x", True)),
        ({"\ud800": 1}, (None, True)),
        ("\ud800", (None, False)),
        ({"model": "m", "prompt": "\U0001F600 caf\u00e9", "ids": [1, 2.5, None, True]}, None),
    ],
)
def test_the_first_lone_surrogate_is_found_at_its_dotted_path(data: Any, found: Any):
    assert lone_surrogate(data) == found


def test_the_surrogate_search_takes_any_depth_the_parser_took():
    deep: Any = "\ud800"
    for _ in range(50_000):
        deep = [deep]
    assert lone_surrogate({"metadata": deep}) == ("metadata" + ".0" * 50_000, False)


def test_an_error_body_escapes_what_utf8_cannot_encode():
    body = OpenAIError(404, "The model '\ud800' does not exist", param="mo\udfffdel", code="c\ud800").body()
    assert body == {"error": {"message": "The model '\\ud800' does not exist", "type": "not_found_error",
                              "param": "mo\\udfffdel", "code": "c\\ud800"}}
    assert json.dumps(body, ensure_ascii=False).encode("utf-8")  # encodable
    assert printable("caf\u00e9 \U0001F600") == "caf\u00e9 \U0001F600"


# ---------------------------------------------------------------- cancellations


@pytest.mark.parametrize(
    ("exc", "cancelled"),
    [
        (asyncio.CancelledError(), True),
        (TaskCancelledError(), True),
        (RequestCancelledError("req-1"), True),
        (RayTaskError("f", "tb", TaskCancelledError()).as_instanceof_cause(), True),
        (RayTaskError("f", "tb", asyncio.CancelledError()).as_instanceof_cause(), True),
        (RayTaskError("f", "tb", RuntimeError("x")).as_instanceof_cause(), False),
        (ActorDiedError(), False),
        (RuntimeError("cancelled"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_a_cancellation_is_told_from_a_failure(exc: BaseException, cancelled: bool):
    assert is_cancellation(exc) is cancelled
