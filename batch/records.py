"""One output line of a batch job: `{"image": key, "result": {...}}` or `{"image": key, "error": {...}}`.

The same encoding serves the local run, the Ray actors and the resumable writer, so a Ray run and
a local run of one job produce byte-identical lines. Results become plain JSON: a skill's result
dict loses its `.image` (never serialized), a pydantic `output` (generate with a model class) is
dumped in JSON mode, anything else JSON cannot hold is written as its repr.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Record:
    """One image's outcome: exactly one of `result` (a plain dict) and `error` ({"type", "message"})."""

    image: str
    result: dict | None = None
    error: dict | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> str:
        """The output line (no newline): keys in a fixed order, non-ASCII kept as is."""
        body: dict[str, Any] = {"image": self.image}
        body.update({"result": self.result} if self.error is None else {"error": self.error})
        return json.dumps(body, ensure_ascii=False, default=_plain)

    @classmethod
    def from_json(cls, line: str) -> Record:
        data = json.loads(line)
        return cls(data["image"], data.get("result"), data.get("error"))


def record_of(key: str, outcome: Any) -> Record:
    """The record of a skill's result, or of the exception an image's call raised."""
    if isinstance(outcome, BaseException):
        return Record(key, error={"type": type(outcome).__name__, "message": str(outcome)})
    return Record(key, result=plain_result(outcome))


def plain_result(result: Any) -> dict:
    """A skill result as JSON-ready data (a round trip through JSON: no image, no pydantic objects)."""
    return json.loads(json.dumps(dict(result), ensure_ascii=False, default=_plain))


def _plain(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)  # pydantic models (generate's output)
    if callable(dump):
        return dump(mode="json")
    return repr(value)
