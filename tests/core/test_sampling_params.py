"""SamplingParams: its defaults, what it normalises, and every bad value refused naming its field."""

import math

import pytest

from minfer.engine.sampling_params import SamplingParams
from minfer.errors import InvalidParameter

SP = SamplingParams


def test_params_defaults_and_normalisation():
    p = SP()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p) == (16, 1.0, 0, 1.0)
    assert p.seed is None and p.stop is None and p.stop_token_ids is None and not p.ignore_eos
    assert not p.is_greedy
    assert SP(temperature=0).is_greedy and SP(top_k=1).is_greedy
    assert SP(stop="\n").stop == ["\n"]
    assert SP(stop=("a", "bc")).stop == ["a", "bc"]
    assert SP(stop_token_ids=(50256,)).stop_token_ids == [50256]
    assert SP(temperature=1).temperature == 1.0 and isinstance(SP(temperature=1).temperature, float)
    assert SP(seed=-5).seed == -5
    assert SP(top_k=-1).top_k == 0 and not SP(top_k=-1).uses_sampling_controls  # vLLM's other "off"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)


def test_invalid_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(InvalidParameter) as err:
        SP(**kwargs)
    assert err.value.param == field and err.value.code == "invalid_value"
    assert str(err.value).startswith(field + " ")


def test_max_tokens_none_is_vllms_up_to_the_context():
    assert SP(max_tokens=None).max_tokens is None and SP(max_tokens=None, min_tokens=100).min_tokens == 100
