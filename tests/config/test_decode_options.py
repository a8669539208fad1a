"""`DecodeOptions`: every decoding rule checked once, at construction, naming the field; the
config, the flags' check and the engine raising its errors in their own words."""

import math

import numpy as np
import pytest

from mars_jax import acceptance, config, decode
from mars_jax.decode_options import (
    CACHE_MODES,
    RULES,
    CacheMode,
    DecodeOptions,
    OptionError,
    Rule,
)
from mars_jax.errors import InputError, SettingError
from tests.helpers import tiny_config


def test_names_become_enums_and_values_are_normalised():
    o = DecodeOptions(block_size=np.int64(4), threshold="0.9", cache_mode="none", rule="margin")
    assert (o.block_size, o.threshold, o.cache_mode, o.rule) == (
        4,
        0.9,
        CacheMode.NONE,
        Rule.MARGIN,
    )
    assert type(o.block_size) is int and o.accept_limit == 4 and not o.sampling
    assert DecodeOptions(threshold=[1.0, 0.5]).threshold == (1.0, 0.5)
    assert DecodeOptions(threshold=np.float32(0.5)).threshold == 0.5
    assert DecodeOptions(block_size=4, max_accept_per_step=2).accept_limit == 2
    assert DecodeOptions(temperature=0.7).sampling
    # Hashable and equal by value (a jit cache key, a dict key).
    assert hash(DecodeOptions(rule="prob")) == hash(DecodeOptions(rule=Rule.PROB))
    assert CACHE_MODES == ("sliding", "block", "none") and RULES == tuple(
        acceptance.ACCEPTANCE_RULES
    )


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"threshold": 2.0}, "threshold", r"^threshold must lie in \(0, 1\], got 2\.0$"),
        ({"threshold": 0}, "threshold", r"^threshold must lie in \(0, 1\], got 0$"),
        ({"threshold": math.nan}, "threshold", r"got nan$"),
        ({"threshold": True}, "threshold", r"got True$"),
        ({"threshold": [0.5, 0.0]}, "threshold", r"got 0\.0$"),
        ({"threshold": []}, "threshold", r"must list a threshold"),
        ({"threshold": "x"}, "threshold", r"must lie in"),
        ({"block_size": 0}, "block_size", r"^block_size must be >= 1, got 0$"),
        ({"block_size": 2.5}, "block_size", r"must be an integer"),
        ({"max_new_tokens": -1}, "max_new_tokens", r"must be >= 0, got -1"),
        ({"temperature": -0.1}, "temperature", r"^temperature must be >= 0"),
        ({"temperature": math.nan}, "temperature", r"^temperature must be >= 0"),
        ({"cache_mode": "paged"}, "cache_mode", r"must be one of \('sliding', 'block', 'none'\)"),
        ({"rule": "topk"}, "rule", r"^rule must be one of \('prob', "),
        ({"max_accept_per_step": 0}, "max_accept_per_step", r"must be >= 1, got 0"),
        ({"rule": "verify", "temperature": 0.5}, "rule", r"^rule='verify' reproduces greedy AR"),
        ({"rule": "verify", "cache_mode": "block"}, "rule", r"cache_mode 'block'\)$"),
    ],
)
def test_each_bad_value_names_its_field(fields, field, message):
    with pytest.raises(OptionError, match=message) as err:
        DecodeOptions(**fields)
    assert err.value.field == field
    assert isinstance(err.value, InputError) and isinstance(err.value, ValueError)


def test_replace_checks_again():
    o = DecodeOptions(block_size=4, rule="verify")
    assert o.replace(threshold=0.5).threshold == 0.5
    with pytest.raises(OptionError, match="verify"):
        o.replace(temperature=1.0)


def test_the_config_names_its_keys():
    good = tiny_config("mars", eval__rule="entropy", eval__thresholds=(1.0, 0.8))
    config.validate(good, training=False)
    opts = DecodeOptions.from_eval(good.eval, block_size=4, threshold=0.8)
    assert (opts.rule, opts.threshold, opts.max_new_tokens) == (
        Rule.ENTROPY,
        0.8,
        good.eval.max_new_tokens,
    )
    for override, message in [
        ({"eval__thresholds": (1.0, 1.5)}, r"^eval\.thresholds=\(1\.0, 1\.5\): 1\.5 is outside"),
        ({"eval__cache_mode": "paged"}, r"^eval\.cache_mode='paged': must be one of"),
        (
            {"eval__rule": "verify", "eval__temperature": 1.0},
            r"^eval\.rule='verify': reproduces greedy AR decoding: it needs eval\.temperature 0",
        ),
    ]:
        with pytest.raises(SettingError, match=message):
            config.validate(tiny_config("mars", **override), training=False)


def test_the_flags_check_prefixes_and_returns_the_options():
    got = config.check_decoding(threshold=0.5, block_size=None, rule="margin")
    assert got == DecodeOptions(threshold=0.5, rule="margin")
    with pytest.raises(OptionError, match=r"^mars_jax: threshold must lie") as err:
        config.check_decoding(threshold=3.0, prefix="mars_jax: ")
    assert err.value.field == "threshold"


def test_decode_generate_takes_options_or_fields_not_both():
    with pytest.raises(InputError, match="not both"):
        decode.generate(
            None,
            np.zeros((1, 2), np.int32),
            np.array([2]),
            DecodeOptions(),
            eos_ids=(),
            mask_id=None,
            threshold=0.5,
        )
    with pytest.raises(InputError, match="2 values for 1 rows"):
        decode.generate(
            None,
            np.zeros((1, 2), np.int32),
            np.array([2]),
            DecodeOptions(threshold=(1.0, 0.5), max_new_tokens=0),
            eos_ids=(),
            mask_id=None,
        )
