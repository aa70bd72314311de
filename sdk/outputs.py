"""`generate(..., output_type=T)`: the parser that turns the constrained text into a value of T.

The grammar layer (`foveal.grammars.compile`) decides what text may be generated for an output
type; this module decides what the caller gets back for that text:

| output_type                                   | output                                  |
|-----------------------------------------------|-----------------------------------------|
| None                                          | the text                                |
| a pydantic model class                        | an instance (`model_validate_json`)     |
| dataclass, TypedDict, list[...], dict[...]    | `pydantic.TypeAdapter(T).validate_json` |
| a JSON-schema dict (or True), outlines JsonSchema | `json.loads` of the text            |
| Regex, CFG, outlines Regex/CFG/terms, str     | the text                                |
| typing.Literal / list of choices              | the chosen literal value                |
| an Enum class                                 | the chosen member                       |
| int, float, bool, date, time, datetime        | the value (pydantic's lax conversion)   |
| grammars.spatial.points / boxes               | the point / detect result dict          |

The text is valid by construction, so a parse failure means the output was cut short (max_tokens)
or the spec and this table disagree: both raise, never return a guess.
"""

from __future__ import annotations

import datetime
import enum
import json
import typing
from collections.abc import Callable
from typing import Any

import pydantic

from foveal.grammars import CFG, Regex, spatial

SCALARS = (int, float, bool, datetime.date, datetime.time, datetime.datetime)


def output_parser(output_type: Any) -> Callable[[str], Any]:
    """The parser of `generate`'s text for `output_type` (see the module table)."""
    if output_type is None or output_type is str or isinstance(output_type, Regex | CFG):
        return str
    if isinstance(output_type, dict | bool):
        return json.loads
    if isinstance(output_type, spatial.SpatialSpec):
        return lambda text: spatial.parse(output_type, text)
    if typing.get_origin(output_type) is typing.Literal:
        return _choice({_text(v): v for v in typing.get_args(output_type)})
    if isinstance(output_type, list | tuple):
        return _choice({str(v): v for v in output_type})
    if isinstance(output_type, type) and issubclass(output_type, enum.Enum):
        return _choice({_text(m.value): m for m in output_type})
    if isinstance(output_type, type) and issubclass(output_type, pydantic.BaseModel):
        return output_type.model_validate_json
    if output_type in SCALARS:
        return pydantic.TypeAdapter(output_type).validate_python
    if type(output_type).__module__.startswith("outlines"):
        return _outlines_parser(output_type)
    # Built at parse time: by then grammars.compile has refused any type it cannot enforce.
    return lambda text: pydantic.TypeAdapter(output_type).validate_json(text)


def _text(value: Any) -> str:
    # Mirrors foveal.grammars' rendering of literal values (booleans as JSON words).
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else str(value)


def _choice(table: dict[str, Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if text not in table:
            raise ValueError(f"{text!r} is none of the choices {sorted(table)}")
        return table[text]

    return parse


def _outlines_parser(output_type: Any) -> Callable[[str], Any]:
    from outlines.types import dsl

    if isinstance(output_type, dsl.JsonSchema):
        return json.loads
    return str
