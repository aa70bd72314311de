"""validate_settings: defaults per skill, accepted values, and a ValueError naming the key for each bad one."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from foveal.settings import (
    MAX_OBJECTS_CEILING,
    MAX_TOKENS_CEILING,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SKILL_DEFAULTS,
    Settings,
    validate_settings,
)

SKILLS = ["caption", "query", "detect", "point", "generate"]


@pytest.mark.parametrize("skill", SKILLS)
def test_defaults_are_greedy_and_per_skill(skill):
    settings = validate_settings(None, skill)
    assert settings == SKILL_DEFAULTS[skill]
    assert settings.greedy and settings.temperature == 0.0 and settings.seed is None
    assert validate_settings({}, skill) == settings


def test_token_budgets_differ_per_skill():
    assert validate_settings(None, "detect").max_tokens > validate_settings(None, "caption").max_tokens


def test_given_values_override_defaults_and_keep_the_rest():
    settings = validate_settings({"temperature": 0.7, "top_p": 0.9, "seed": 3}, "caption")
    assert (settings.temperature, settings.top_p, settings.seed) == (0.7, 0.9, 3)
    assert settings.max_tokens == SKILL_DEFAULTS["caption"].max_tokens
    assert not settings.greedy


def test_boundaries_are_accepted():
    settings = validate_settings(
        {
            "temperature": 0,
            "top_p": 1,
            "max_tokens": MAX_TOKENS_CEILING,
            "max_objects": MAX_OBJECTS_CEILING,
            "seed": 0,
        },
        "detect",
    )
    assert settings.max_tokens == MAX_TOKENS_CEILING and settings.max_objects == MAX_OBJECTS_CEILING
    assert (
        validate_settings({"max_tokens": 1, "max_objects": 1, "seed": 2**64 - 1}, "point").seed == 2**64 - 1
    )
    assert validate_settings({"top_p": 1e-9, "temperature": 2.0}).top_p == 1e-9


def test_numpy_numbers_become_plain_python_numbers():
    settings = validate_settings(
        {"temperature": np.float32(0.5), "max_tokens": np.int64(64), "seed": np.uint64(7)}
    )
    assert (
        type(settings.temperature) is float
        and type(settings.max_tokens) is int
        and type(settings.seed) is int
    )
    json.dumps(dataclasses.asdict(settings))


def test_settings_are_frozen_and_hashable():
    settings = validate_settings({"seed": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.seed = 2
    assert hash(settings) == hash(validate_settings({"seed": 1}))


def test_a_settings_instance_passes_through():
    settings = Settings(temperature=0.2)
    assert validate_settings(settings, "query") is settings


def test_direct_construction_and_replace_are_validated_too():
    with pytest.raises(ValueError, match="'top_p'"):
        Settings(top_p=2)
    with pytest.raises(ValueError, match="'max_tokens'"):
        dataclasses.replace(Settings(), max_tokens=0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"temperature": -0.1}, r"'temperature' = -0.1 .*number in \[0, 2.0\]"),
        ({"temperature": math.inf}, r"'temperature' = inf"),
        ({"temperature": math.nan}, r"'temperature' = nan"),
        ({"temperature": "0.5"}, r"'temperature' = '0.5'"),
        ({"temperature": None}, r"'temperature' = None"),
        ({"temperature": True}, r"'temperature' = True"),
        ({"top_p": 0}, r"'top_p' = 0 .*0 < top_p <= 1"),
        ({"top_p": 1.01}, r"'top_p' = 1.01 .*0 < top_p <= 1"),
        ({"top_p": -0.5}, r"'top_p' = -0.5"),
        ({"top_p": math.nan}, r"'top_p' = nan"),
        ({"max_tokens": 0}, rf"'max_tokens' = 0 .*1 <= max_tokens <= {MAX_TOKENS_CEILING}"),
        ({"max_tokens": MAX_TOKENS_CEILING + 1}, rf"'max_tokens' = {MAX_TOKENS_CEILING + 1}"),
        ({"max_tokens": 10**12}, r"'max_tokens' = 1000000000000"),
        ({"max_tokens": 64.0}, r"'max_tokens' = 64.0 .*an int"),
        ({"max_tokens": "64"}, r"'max_tokens' = '64'"),
        ({"max_tokens": False}, r"'max_tokens' = False"),
        ({"max_objects": 0}, rf"'max_objects' = 0 .*1 <= max_objects <= {MAX_OBJECTS_CEILING}"),
        ({"max_objects": MAX_OBJECTS_CEILING + 1}, r"'max_objects'"),
        ({"max_objects": 2.5}, r"'max_objects' = 2.5"),
        ({"seed": -1}, r"'seed' = -1 .*0 <= seed <= 2\*\*64 - 1"),
        ({"seed": 2**64}, r"'seed' = 18446744073709551616"),
        ({"seed": 1.0}, r"'seed' = 1.0"),
        ({"seed": "42"}, r"'seed' = '42'"),
    ],
)
def test_bad_values_name_the_key_and_range(settings, message):
    with pytest.raises(ValueError, match=message):
        validate_settings(settings, "detect")


def test_unknown_keys_are_named_with_a_suggestion():
    with pytest.raises(
        ValueError, match=r"unknown setting 'temprature' \(did you mean 'temperature'\?\); accepted"
    ):
        validate_settings({"temprature": 0.5})
    with pytest.raises(
        ValueError, match=r"unknown setting 'stream'; accepted settings: adapter, max_objects, max_tokens"
    ):
        validate_settings({"stream": True})
    with pytest.raises(ValueError, match=r"unknown setting 3"):
        validate_settings({3: 1})


@pytest.mark.parametrize("skill", ["caption", "query", "generate"])
def test_max_objects_is_refused_for_skills_without_objects(skill):
    with pytest.raises(ValueError, match=rf"'max_objects' applies to detect, point, not {skill}"):
        validate_settings({"max_objects": 5}, skill)


@pytest.mark.parametrize("bad", [[("temperature", 0.5)], "temperature=0.5", 0.5, Settings])
def test_settings_must_be_a_dict(bad):
    with pytest.raises(ValueError, match="settings must be a dict"):
        validate_settings(bad)


def test_unknown_skill():
    with pytest.raises(ValueError, match="unknown skill 'frobnicate'"):
        validate_settings(None, "frobnicate")
    assert validate_settings(None, "segment").max_tokens == 768  # an outline takes many tokens


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"top_p": 1e-46}, r"'top_p' = 1e-46 .*1.18e-38 <= top_p <= 1: the engine samples in float32"),
        ({"top_p": 1e-300}, r"'top_p' = 1e-300 .*underflows"),
        ({"top_p": 1e-40}, r"'top_p' = 1e-40 .*subnormal"),  # float32 holds it as a subnormal
        ({"temperature": 1e-300}, r"'temperature' = 1e-300 .*0 \(greedy\) or a number in \[1e-06, 2.0\]"),
        ({"temperature": 5e-324}, r"'temperature' = 5e-324 .*use 0 for greedy decoding"),
        ({"temperature": 1e-40}, r"'temperature' = 1e-40"),
        ({"temperature": 1e-7}, r"'temperature' = 1e-07"),
    ],
)
def test_sampling_settings_that_underflow_float32_are_refused(settings, message):
    # Before: accepted, and on the engine's float32 a top_p of 0 kept no token (500s, or empty answers
    # after the whole token budget); detect, caption and chat all validate through here.
    with pytest.raises(ValueError, match=message):
        validate_settings(settings, "caption")


def test_the_underflow_bounds_are_accepted():
    assert validate_settings({"top_p": MIN_TOP_P}).top_p == MIN_TOP_P == 2.0**-126
    assert validate_settings({"temperature": MIN_TEMPERATURE}).temperature == MIN_TEMPERATURE == 1e-6
    assert validate_settings({"temperature": 0.0, "top_p": 1e-9}).greedy
