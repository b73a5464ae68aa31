"""SamplingParams: refusals name the field and the allowed range; defaults are neutral."""

import pytest

from polyengine.errors import InvalidRequest
from polyengine.sampling import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        ({"temperature": -0.5}, "temperature", "[0.0, 100.0]"),
        ({"top_p": 0.0}, "top_p", "(0.0, 1.0]"),
        ({"top_p": 1.5}, "top_p", "(0.0, 1.0]"),
        ({"top_k": -1}, "top_k", "[0, inf)"),
        ({"n": 0}, "n", "[1, 4096]"),
        ({"min_p": 2.0}, "min_p", "[0.0, 1.0]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "(0.0, 100.0]"),
        ({"presence_penalty": 3.0}, "presence_penalty", "[-2.0, 2.0]"),
        ({"frequency_penalty": -3.0}, "frequency_penalty", "[-2.0, 2.0]"),
        ({"max_tokens": 0}, "max_tokens", "[1, inf)"),
        ({"seed": -1}, "seed", "[0, "),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ],
)
def test_out_of_range_names_field_and_range(kwargs, field, allowed):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.create(**kwargs)
    msg = str(info.value)
    assert f"{field}:" in msg
    assert f"allowed range {allowed}" in msg
    assert repr(next(iter(kwargs.values()))) in msg or "got" in msg


def test_min_tokens_above_max_tokens():
    with pytest.raises(InvalidRequest, match=r"min_tokens \(5\) must be <= max_tokens \(3\)"):
        SamplingParams.create(min_tokens=5, max_tokens=3)
    assert SamplingParams.create(min_tokens=3, max_tokens=3).min_tokens == 3


def test_unknown_field_lists_known_fields():
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.create(temprature=0.5)
    msg = str(info.value)
    assert "temprature: unknown field" in msg
    assert "temperature" in msg.split("known fields:")[1]


@pytest.mark.parametrize(
    "bias, fragment",
    [
        ({-1: 1.0}, "token id -1 must be >= 0"),
        ({5: 101.0}, "must be in [-100, 100]"),
        ({5: float("nan")}, "must be in [-100, 100]"),
        ({5: float("-inf")}, "must be in [-100, 100]"),
        ({"x": 1.0}, "logit_bias"),
    ],
)
def test_bad_logit_bias(bias, fragment):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.create(logit_bias=bias)
    assert "logit_bias" in str(info.value)
    assert fragment in str(info.value)


def test_other_refusals():
    with pytest.raises(InvalidRequest, match="top_logprobs > 0 needs logprobs=True"):
        SamplingParams.create(top_logprobs=2)
    with pytest.raises(InvalidRequest, match="stop"):
        SamplingParams.create(stop=["ok", ""])
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        SamplingParams.create(stop_token_ids=[3, -2])
    with pytest.raises(InvalidRequest, match="sampling must be"):
        SamplingParams.coerce(0.5)


def test_errors_are_also_value_errors():
    with pytest.raises(ValueError):
        SamplingParams.create(temperature=-1)


def test_defaults_are_neutral_and_active_fields():
    p = SamplingParams()
    assert p.active_fields() == frozenset()
    assert not p.greedy
    q = SamplingParams.create(temperature=0, top_k=5, stop="END", seed=3)
    assert q.greedy and q.stop == ("END",)
    assert q.active_fields() == {"temperature", "top_k", "stop"}  # the seed is not a feature


def test_with_seed_replace_coerce():
    p = SamplingParams()
    s = p.with_seed()
    assert s.seed is not None and 0 <= s.seed < 2**64
    assert s.with_seed() is s
    assert p.replace(top_p=0.5).top_p == 0.5
    with pytest.raises(InvalidRequest, match="top_p"):
        p.replace(top_p=2)
    assert SamplingParams.coerce(None) == SamplingParams()
    assert SamplingParams.coerce({"top_k": 3}).top_k == 3
    assert SamplingParams.coerce(s) is s
    with pytest.raises(Exception):
        s.temperature = 0.3  # frozen


@pytest.mark.parametrize("kwargs, field", [
    (dict(top_p=2), "top_p"),
    (dict(n=0), "n"),
    (dict(bogus=1), "bogus"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens"),  # cross-field: the first field the message names
    (dict(top_logprobs=2), "top_logprobs"),
])
def test_invalid_request_names_the_field_at_fault(kwargs, field):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
