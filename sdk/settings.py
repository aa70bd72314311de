"""Sampling settings: the `settings={...}` dict of every skill, checked before any work starts.

A caller writes `model.detect(img, "car", settings={"max_objects": 5, "temperature": 0.5})`. The dict
is turned into a frozen `Settings`, starting from the skill's defaults (greedy decoding everywhere;
token budgets sized per skill). Anything wrong raises ValueError naming the key and what is accepted:
unknown keys (with a spelling suggestion), wrong types, out-of-range values, and `max_objects` given
to a skill that returns no objects. A `Settings` can only exist with valid values: `__post_init__`
checks them, so `dataclasses.replace` and direct construction are safe too.

Accepted keys and ranges:
    temperature  float, 0 (greedy: always the most likely allowed token) or MIN_TEMPERATURE (1e-6) <=
                 temperature <= MAX_TEMPERATURE (2.0, as OpenAI's API; above 2 sampling is close to
                 uniform over the allowed tokens and free text turns to noise). Below 1e-6 sampling
                 is greedy decoding in all but exact ties, and the engine's float32 logits / temperature
                 overflow (1e-40 is a float32 subnormal, 1e-300 rounds to 0): such values are refused
    top_p        float, MIN_TOP_P <= top_p <= 1 (1 disables nucleus sampling); MIN_TOP_P = 2**-126
                 (1.18e-38), float32's smallest normal number: the engine samples in float32, where
                 1e-46 is 0 and would keep no token, so a value that underflows is refused. Any top_p
                 at or below 1 / vocabulary size (1e-6 for every real model) keeps only the most
                 likely allowed token
    max_tokens   int, 1 <= max_tokens <= MAX_TOKENS_CEILING (8192)
    max_objects  int, 1 <= max_objects <= MAX_OBJECTS_CEILING (1000); detect and point only
    seed         int, 0 <= seed < 2**64, or None (no seed)
    min_score    float, 0 <= min_score <= 1; detect and point only: boxes and points whose "score" is
                 below it are left out (docs/scores.md defines the score)
    stop         a list (or tuple) of at most MAX_STOPS (16) non-empty strings: free text ends before
                 the first of them (not included) and the usage's finish_reason is "stop"; skills
                 whose answer is decoded under a grammar refuse it (the grammar decides the end)
    variant      a LoRA variant's name or file path (Moondream's `settings["variant"]`), or None;
                 families without variants refuse it (the family resolves and loads it)
    adapter      a fine-tune's adapter as Moondream's API names it, `<finetune_id>@<step>`, or its file
                 path, or None; families without adapters (Moondream 3 has them) refuse it
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

MAX_TOKENS_CEILING = 8192
MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 1e-6  # above 0: below it greedy in all but ties; near 1e-38 float32 logits / temperature overflow
MIN_TOP_P = 2.0**-126  # float32's smallest normal number: the engine's sampler is float32
MAX_STOPS = 16
MAX_OBJECTS_CEILING = 1000
SEED_LIMIT = 2**64
OBJECT_SKILLS = ("detect", "point")  # generate's output_type states its own limits (e.g. maxItems)


@dataclass(frozen=True, slots=True)
class Settings:
    """Validated sampling settings of one call (see the module docstring for the ranges)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    max_objects: int = 50
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_score: float = 0.0
    variant: str | None = None
    adapter: str | None = None

    def __post_init__(self) -> None:
        # object.__setattr__: the dataclass is frozen; values are normalized to plain Python numbers.
        object.__setattr__(self, "temperature", _temperature(self.temperature))
        object.__setattr__(self, "top_p", _top_p(self.top_p))
        object.__setattr__(self, "max_tokens", _int("max_tokens", self.max_tokens, 1, MAX_TOKENS_CEILING))
        object.__setattr__(self, "max_objects", _int("max_objects", self.max_objects, 1, MAX_OBJECTS_CEILING))
        if self.seed is not None:
            object.__setattr__(self, "seed", _int("seed", self.seed, 0, SEED_LIMIT - 1, "2**64 - 1"))
        object.__setattr__(self, "stop", _stops(self.stop))
        if self.variant is not None and (not isinstance(self.variant, str) or not self.variant.strip()):
            raise ValueError(
                f"setting 'variant' = {self.variant!r:.80} is not accepted; it must be a variant's name or file path, or None"
            )
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter.strip()):
            raise ValueError(
                f"setting 'adapter' = {self.adapter!r:.80} is not accepted; it must be '<finetune_id>@<step>' or an "
                "adapter file's path, or None"
            )
        object.__setattr__(self, "min_score", _real("min_score", self.min_score, 0.0, 1.0, "number in [0, 1]"))

    @property
    def greedy(self) -> bool:
        """True when decoding picks the most likely allowed token at every step."""
        return self.temperature == 0.0


def validate_settings(settings: Mapping[str, Any] | Settings | None, skill: str = "generate") -> Settings:
    """Return the skill's default `Settings` updated by `settings`; raise ValueError naming any bad key."""
    if skill not in SKILL_DEFAULTS:
        raise ValueError(f"unknown skill {skill!r}; one of {', '.join(SKILL_DEFAULTS)}")
    if isinstance(settings, Settings):
        return settings
    if settings is None:
        return SKILL_DEFAULTS[skill]
    if not isinstance(settings, Mapping):
        raise ValueError(
            f"settings must be a dict such as {{'temperature': 0.5, 'max_tokens': 128}}, got {type(settings).__name__}"
        )
    for key in settings:
        _check_key(key, skill)
    return dataclasses.replace(SKILL_DEFAULTS[skill], **settings)


def _check_key(key: Any, skill: str) -> None:
    if key not in KEYS:
        close = difflib.get_close_matches(str(key), KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown setting {key!r}{hint}; accepted settings: {', '.join(sorted(KEYS))}")
    if key in ("max_objects", "min_score") and skill not in OBJECT_SKILLS:
        raise ValueError(f"setting {key!r} applies to {', '.join(OBJECT_SKILLS)}, not {skill}; remove it")


def _real(key: str, value: Any, low: float, high: float, accepted: str) -> float:
    number = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    if not number or not low <= value <= high:
        raise ValueError(f"setting {key!r} = {value!r} is not accepted; it must be a {accepted}")
    return float(value)


def _temperature(value: Any) -> float:
    accepted = f"number in [0, {MAX_TEMPERATURE}] (0 = greedy)"
    temperature = _real("temperature", value, 0.0, MAX_TEMPERATURE, accepted)
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"setting 'temperature' = {value!r} is not accepted; it must be 0 (greedy) or a number in "
            f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE}]: below {MIN_TEMPERATURE:g} sampling is greedy decoding in "
            "all but exact ties, and near float32's limit (1e-38) the engine's logits / temperature overflow; "
            "use 0 for greedy decoding"
        )
    return temperature


def _top_p(value: Any) -> float:
    top_p = _real("top_p", value, 0.0, 1.0, "number with 0 < top_p <= 1")
    if top_p == 0.0:
        raise ValueError("setting 'top_p' = 0 is not accepted; it must be a number with 0 < top_p <= 1")
    if top_p < MIN_TOP_P:
        raise ValueError(
            f"setting 'top_p' = {value!r} is not accepted; it must be a number with {MIN_TOP_P:.3g} <= top_p <= 1: "
            "the engine samples in float32, where it underflows (to 0 or a subnormal number); any top_p "
            "at or below 1e-6 keeps only the most likely token, so use 1e-6 (or temperature 0 for greedy decoding)"
        )
    return top_p


def _stops(value: Any) -> tuple[str, ...]:
    accepted = f"a list of at most {MAX_STOPS} non-empty strings, e.g. ['\\n\\n']"
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ValueError(f"setting 'stop' = {value!r:.80} is not accepted; it must be {accepted}")
    if len(value) > MAX_STOPS or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"setting 'stop' = {value!r:.80} is not accepted; it must be {accepted}")
    return tuple(value)


def _int(key: str, value: Any, low: int, high: int, high_text: str = "") -> int:
    # typeshed gives numbers.Integral no __ge__, which `low <= value` falls back to (numpy's ints have it)
    if not isinstance(value, Integral) or isinstance(value, bool) or not low <= value <= high:  # type: ignore[operator]
        bound = high_text or str(high)
        raise ValueError(
            f"setting {key!r} = {value!r} is not accepted; it must be an int with {low} <= {key} <= {bound}"
        )
    return int(value)


# Built last: constructing a Settings runs the checks above.
SKILL_DEFAULTS: dict[str, Settings] = {
    "caption": Settings(max_tokens=256),
    "query": Settings(max_tokens=512),
    "detect": Settings(max_tokens=2048, max_objects=50),
    "point": Settings(max_tokens=1024, max_objects=50),
    "generate": Settings(max_tokens=512),
    "segment": Settings(max_tokens=768),  # an outline is long: Moondream's engine allows 768 by default
}
KEYS = tuple(field.name for field in dataclasses.fields(Settings))
