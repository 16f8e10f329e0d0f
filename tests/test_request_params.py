"""Sampling parameters are range-checked once, by SamplingParams; the request models add only the wire's
rules and OpenAI's caps, and an out-of-range value is reported under the request field that carried it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagoda.sampling import InvalidParam, SamplingParams
from pagoda.wire import ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "hi"}]


def invalid_param(request) -> InvalidParam:
    with pytest.raises(InvalidParam) as raised:
        request.sampling_params(request.num_logprobs() if isinstance(request, ChatCompletionRequest)
                                else request.logprobs)
    return raised.value


@pytest.mark.parametrize("fields,param", [
    ({"top_p": 0.0}, "top_p"),
    ({"seed": 2**63}, "seed"),
    ({"logprobs": 21}, "logprobs"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stop": ""}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_completion_ranges_come_from_sampling_params_naming_the_field(fields, param):
    error = invalid_param(CompletionRequest(prompt="x", **fields))
    assert error.param == param and str(error).startswith(param)


@pytest.mark.parametrize("fields,param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
])
def test_chat_errors_name_the_chat_field_not_the_engine_parameter(fields, param):
    error = invalid_param(ChatCompletionRequest(messages=CHAT, **fields))
    assert error.param == param and str(error).startswith(f"{param} must")


def test_max_completion_tokens_wins_over_max_tokens():
    request = ChatCompletionRequest(messages=CHAT, max_tokens=5, max_completion_tokens=9)
    assert request.sampling_params(None).max_tokens == 9


@pytest.mark.parametrize("fields", [{"temperature": 2.5}, {"n": 129}, {"stop": ["x"] * 17}, {"logit_bias": {"a": 1}}])
def test_the_wire_keeps_openais_caps_and_its_own_shapes(fields):
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", **fields)


def test_the_engine_takes_what_only_openais_caps_refuse():
    assert SamplingParams(temperature=5.0, n=200).temperature == 5.0


def test_logit_bias_values_are_range_checked_in_the_engine_too():
    with pytest.raises(InvalidParam, match=r"logit_bias values must be in \[-100, 100\]") as raised:
        SamplingParams(logit_bias={3: -100.5})
    assert raised.value.param == "logit_bias"
