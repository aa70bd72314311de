"""The skill a batch job runs on every image, its arguments, and the checks made before any image is read.

A job is one skill with fixed arguments: detect/point take an object phrase, query a question,
caption a length, generate a prompt and an optional output type (a JSON schema from `--schema`).
`SkillCall.of` refuses what can be refused without the model (unknown skill, a missing or
misplaced argument, settings `foveal.settings.validate_settings` refuses); `check(model)` refuses, once the model is loaded and still before any image,
what needs it: the arguments and settings as the SDK checks them (`Model.map` on no images runs
exactly those checks), and an output type the grammar cannot enforce (compiled once here; the
SDK caches the compile for the calls). Each image's call is then `call(model, image)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SKILLS = ("detect", "point", "caption", "query", "generate")
ARGUMENT = {
    "detect": "object",
    "point": "object",
    "query": "question",
    "caption": "length",
    "generate": "prompt",
}
OPTIONAL = {"caption": "normal"}  # the arguments with a default


@dataclass(frozen=True)
class SkillCall:
    """`skill` with its one argument (`argument`), an output type for generate, and settings."""

    skill: str
    argument: str
    output_type: Any = None
    settings: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        skill: str,
        *,
        object: str | None = None,
        question: str | None = None,
        length: str | None = None,
        prompt: str | None = None,
        output_type: Any = None,
        settings: Mapping[str, Any] | None = None,
    ) -> SkillCall:
        """The job's call, refusing (ValueError) what does not fit the skill."""
        if skill not in SKILLS:
            raise ValueError(f"unknown skill {skill!r}; use one of {', '.join(SKILLS)}")
        given = {"object": object, "question": question, "length": length, "prompt": prompt}
        wanted = ARGUMENT[skill]
        for name, value in given.items():
            if value is not None and name != wanted:
                raise ValueError(f"--{name} does not apply to {skill}; {skill} takes --{wanted}")
        if output_type is not None and skill != "generate":
            raise ValueError(f"--schema applies to generate only, not to {skill}")
        argument = given[wanted] if given[wanted] is not None else OPTIONAL.get(skill)
        if argument is None:
            raise ValueError(f"{skill} needs --{wanted} (e.g. --{wanted} {_EXAMPLE[wanted]!r})")
        from foveal.settings import validate_settings

        validate_settings(settings, skill)  # the SDK's own check of the settings' names and ranges
        return cls(skill, argument, output_type, dict(settings or {}))

    def check(self, model: Any) -> None:
        """Refuse, before any image, what the model refuses: bad argument or settings, an output type
        its grammar cannot enforce (SchemaError). The model's exceptions pass through unchanged."""
        model.map(self.skill, [], *self._args(), progress=False, **self._kwargs())
        if self.output_type is not None:
            model.family.compile(self.output_type)

    def call(self, model: Any, image: Any) -> Any:
        """The skill's result for one image (the SDK's exceptions pass through)."""
        return getattr(model, self.skill)(image, *self._args(), **self._kwargs())

    def _args(self) -> tuple:
        return (self.argument, self.output_type) if self.skill == "generate" else (self.argument,)

    def _kwargs(self) -> dict:
        return {"settings": dict(self.settings)} if self.settings else {}


_EXAMPLE = {
    "object": "car",
    "question": "how many people?",
    "length": "short",
    "prompt": "describe the scene",
}
