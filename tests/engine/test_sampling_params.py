"""SamplingParams: defaults, every invalid value -> InvalidRequestError naming the exact field."""

from __future__ import annotations

import math

import grpc
import pytest

from inference_service.engine.sampling_params import SamplingParams
from inference_service.errors import InvalidRequestError


def test_defaults_match_proto():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert p.logit_bias == {} and p.seed is None and p.logprobs is False and p.top_logprobs == 0
    assert p.max_tokens is None and p.min_tokens == 0 and p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.n == 1 and p.skip_special_tokens is True
    assert not p.is_greedy
    # Mutable defaults are not shared between instances.
    q = SamplingParams()
    q.stop.append("x")
    assert p.stop == []


@pytest.mark.parametrize(
    "kwargs, greedy",
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0}, True),
        ({"temperature": 9e-6}, True),
        ({"temperature": 1e-5}, False),
        ({"top_k": 1}, True),
        ({"top_k": 2, "temperature": 0.7}, False),
        ({"temperature": 0.0, "top_k": 5}, True),
    ],
)
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_valid_edge_values_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, repetition_penalty=1e-3,
                   frequency_penalty=-2.0, presence_penalty=2.0, logit_bias={0: -100.0, 5: 100},
                   seed=2**64 - 1, logprobs=True, top_logprobs=20, max_tokens=1, min_tokens=1,
                   stop=["a", "\n\n"], stop_token_ids=[0, 7], ignore_eos=True, n=128,
                   skip_special_tokens=False)
    SamplingParams(top_p=1e-9, min_p=0.0, seed=0, n=1, top_logprobs=0)


# (kwargs, field, text of the bad value that the message must show)
INVALID = [
    ({"temperature": -0.1}, "sampling.temperature", "-0.1"),
    ({"temperature": math.nan}, "sampling.temperature", "nan"),
    ({"temperature": math.inf}, "sampling.temperature", "inf"),
    ({"temperature": "1"}, "sampling.temperature", "'1'"),
    ({"top_p": 0.0}, "sampling.top_p", "0.0"),
    ({"top_p": -0.5}, "sampling.top_p", "-0.5"),
    ({"top_p": 1.0001}, "sampling.top_p", "1.0001"),
    ({"top_p": math.nan}, "sampling.top_p", "nan"),
    ({"top_k": -1}, "sampling.top_k", "-1"),
    ({"top_k": 2.5}, "sampling.top_k", "2.5"),
    ({"min_p": -0.01}, "sampling.min_p", "-0.01"),
    ({"min_p": 1.01}, "sampling.min_p", "1.01"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty", "0.0"),
    ({"repetition_penalty": -1.0}, "sampling.repetition_penalty", "-1.0"),
    ({"repetition_penalty": math.inf}, "sampling.repetition_penalty", "inf"),
    ({"frequency_penalty": 2.01}, "sampling.frequency_penalty", "2.01"),
    ({"frequency_penalty": -2.01}, "sampling.frequency_penalty", "-2.01"),
    ({"presence_penalty": 2.5}, "sampling.presence_penalty", "2.5"),
    ({"presence_penalty": -3}, "sampling.presence_penalty", "-3"),
    ({"logit_bias": {3: 100.5}}, "sampling.logit_bias[3]", "100.5"),
    ({"logit_bias": {3: -101}}, "sampling.logit_bias[3]", "-101"),
    ({"logit_bias": {3: math.nan}}, "sampling.logit_bias[3]", "nan"),
    ({"logit_bias": {-1: 1.0}}, "sampling.logit_bias[-1]", "-1"),
    ({"logit_bias": [1, 2]}, "sampling.logit_bias", "[1, 2]"),
    ({"seed": -1}, "sampling.seed", "-1"),
    ({"seed": 2**64}, "sampling.seed", str(2**64)),
    ({"logprobs": 1}, "sampling.logprobs", "1"),
    ({"top_logprobs": 21}, "sampling.top_logprobs", "21"),
    ({"top_logprobs": -1}, "sampling.top_logprobs", "-1"),
    ({"max_tokens": 0}, "stopping.max_tokens", "0"),
    ({"max_tokens": -5}, "stopping.max_tokens", "-5"),
    ({"min_tokens": -1}, "stopping.min_tokens", "-1"),
    ({"min_tokens": 11, "max_tokens": 10}, "stopping.min_tokens", "11"),
    ({"stop": ["ok", ""]}, "stopping.stop[1]", "''"),
    ({"stop": [""]}, "stopping.stop[0]", "''"),
    ({"stop": [3]}, "stopping.stop[0]", "3"),
    ({"stop": "abc"}, "stopping.stop", "'abc'"),
    ({"stop_token_ids": [1, -2]}, "stopping.stop_token_ids[1]", "-2"),
    ({"ignore_eos": "yes"}, "stopping.ignore_eos", "'yes'"),
    ({"n": 0}, "n", "0"),
    ({"n": 129}, "n", "129"),
    ({"skip_special_tokens": None}, "skip_special_tokens", "None"),
]


@pytest.mark.parametrize("kwargs, field, bad", INVALID, ids=[f"{f}={b}" for _, f, b in INVALID])
def test_invalid_values_raise_with_field(kwargs, field, bad):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    err = info.value
    assert err.field == field
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    # The message names the field and shows the bad value.
    assert field.split("[")[0] in err.message, err.message
    assert bad in err.message, err.message


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"logit_bias": {10: 1.0}}, "sampling.logit_bias[10]"),
        ({"logit_bias": {0: 1.0, 99: 1.0}}, "sampling.logit_bias[99]"),
        ({"stop_token_ids": [3, 10]}, "stopping.stop_token_ids[1]"),
    ],
)
def test_validate_for_model_token_ids(kwargs, field):
    p = SamplingParams(**kwargs)
    with pytest.raises(InvalidRequestError) as info:
        p.validate_for_model(vocab_size=10)
    assert info.value.field == field
    p.validate_for_model(vocab_size=100)


def test_validate_for_model_context_length():
    p = SamplingParams(max_tokens=100)
    p.validate_for_model(vocab_size=10, max_model_len=200, num_prompt_tokens=100)
    with pytest.raises(InvalidRequestError) as info:
        p.validate_for_model(vocab_size=10, max_model_len=200, num_prompt_tokens=101)
    assert info.value.field == "stopping.max_tokens"
    assert "100" in info.value.message and "200" in info.value.message
    # Unset max_tokens runs to the end of the context: nothing to check here.
    SamplingParams().validate_for_model(vocab_size=10, max_model_len=200, num_prompt_tokens=199)
