"""Output specs -> llguidance grammar text, plus the canonical key the compile cache uses.

Accepted specs: a pydantic model class (or any type pydantic can describe: dataclass, TypedDict,
`list[Model]`), a JSON-schema dict, `Regex`, `CFG`, `typing.Literal`, an `enum.Enum` class, a list
or tuple of string choices, and outlines output types (`outlines.types.JsonSchema`, `Regex`, `CFG`,
other outlines terms and the plain python types outlines maps to regexes: int, float, bool, str, ...).

Whitespace policy (JSON): compact, one fixed style, `{"a": 1, "b": [2, 3]}`: no whitespace outside
strings except the single space after `,` and `:`. A random model therefore cannot fill its output
with whitespace, and instances serialized with `separators=(", ", ": ")` are what the grammar emits.
Properties come in the schema's order. `x-guidance` options inside a schema cannot loosen this: our
options are applied as llguidance *overrides*.

Extra keys of pydantic classes: a class that does not say otherwise (pydantic's default
`extra="ignore"`, or `extra="ignore"`/`"forbid"` said explicitly) compiles to objects with
`additionalProperties: false`. Pydantic would drop such keys when validating the output, so they
are never useful, and allowing them lets a random model fill its output with invented keys until
max_tokens. `extra="allow"` keeps them allowed (typed by `__pydantic_extra__` when annotated). This
holds for every class pydantic describes (models, dataclasses, TypedDicts, nested or in `list[...]`);
JSON-schema dicts keep their own semantics (no `additionalProperties` means any extra key).

Format policy (JSON): before llguidance compiles a schema, `formats.exact_string_constraints`
rewrites the string keywords llguidance reads looser than the spec: `date`, `time`, `date-time`
become exact regexes (leap years; leap seconds only at 23:59 UTC), `hostname` a narrower one (no
IDNA A-labels), `pattern` classes `\\s`, `\\S`, `.` are read as ECMA-262 defines them, draft-07
`contentEncoding: base64` is enforced; `idn-hostname`, `idn-email`, `iri`, `iri-reference` and
draft-07 `contentMediaType` are refused with SchemaError. grammars/formats.py documents each rule.

Number policy (JSON): `formats.bounded_numbers` then bounds every side of an `integer` / `number`
that the schema leaves open: integers to [-(2**63 - 1024), 2**63 - 1] (int64 as exactly as llguidance
can build it), numbers to |x| < 10**15 with at most 10 fraction digits; a bound the schema gives is
kept. This holds for every path here (pydantic classes and types, JSON-schema dicts and text,
outlines JsonSchema), so no number can grow until the context is full.

Parsers: every GrammarSource carries the parser of its text (`parse`), decided by the same dispatch
that chose its grammar, so a caller never dispatches on the spec's type a second time:

| spec                                          | parse(text)                             |
|-----------------------------------------------|-----------------------------------------|
| Regex, CFG, outlines Regex/CFG/terms, str     | the text                                |
| a JSON-schema dict (or True), outlines JsonSchema | `json.loads`                        |
| a pydantic model class                        | an instance (`model_validate_json`)     |
| dataclass, TypedDict, list[...], dict[...]    | `pydantic.TypeAdapter(T).validate_json` |
| typing.Literal / list of choices              | the chosen literal value                |
| an Enum class                                 | the chosen member                       |
| int, float, bool, date, time, datetime        | the value (grammars/scalars.py)         |

Valid by construction: every text the grammar accepts is one its parser reads (the regexes of
scalars are our own for that reason; choices whose texts coincide are refused).
"""

from __future__ import annotations

import enum
import functools
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance

from .errors import SchemaError
from .formats import bounded_numbers, exact_string_constraints
from .scalars import SCALARS
from .special_tokens import refuse_special_tokens

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}


@dataclass(frozen=True, slots=True)
class Regex:
    """A regular expression (llguidance/Rust `regex` syntax) the whole output must match."""

    pattern: str


@dataclass(frozen=True, slots=True)
class CFG:
    """A context-free grammar in Lark syntax, llguidance dialect (start rule `start`)."""

    definition: str


@dataclass(frozen=True, slots=True)
class GrammarSource:
    """A spec reduced to what llguidance compiles: kind, canonical cache key, grammar text."""

    kind: str  # "json_schema" | "regex" | "lark" | "choice"
    key: str
    grammar: str
    schema: Any = None  # the JSON schema for kind "json_schema" (for error paths)
    parse: Callable[[str], Any] = str  # the output's text -> the caller's value (module table)
    pattern: str | None = None  # the regex, for kind "regex" (checked before compiling)


def json_schema_source(schema: dict | bool | str, parse: Callable[[str], Any] = json.loads) -> GrammarSource:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise SchemaError(
                f"JSON schema text is not JSON ({err}); pass a dict or valid JSON text"
            ) from err
    if not isinstance(schema, dict | bool):
        raise SchemaError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    if schema is False:
        raise SchemaError("the schema `false` allows no output at all; give a schema some value satisfies")
    if schema is True:
        schema = {}  # same meaning, and llguidance applies options to object schemas only
    schema = bounded_numbers(exact_string_constraints(apply_draft_ref_rule(schema)))
    # Key order is meaningful (property order is the output order), so the key keeps it.
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    except ValueError as err:
        raise SchemaError(f"JSON schema refused: {err}; pass a JSON-schema object") from err
    return GrammarSource("json_schema", "json:" + text, grammar, schema, parse)


_OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")
_REF_KEPT_SIBLINGS = frozenset({"$ref", "definitions", "$defs", "$comment"})
_VALUE_KEYS = frozenset({"enum", "const", "default", "examples"})


def apply_draft_ref_rule(schema: dict | bool) -> dict | bool:
    """Draft-03..07 ignore every keyword next to `$ref`; 2019-09+ (llguidance's reading) apply them.

    For a schema that declares an old draft, drop those siblings (keeping `definitions`, which refs
    may point into) so the grammar means what the schema's own draft says.
    """
    if not isinstance(schema, dict) or not any(d in str(schema.get("$schema", "")) for d in _OLD_DRAFTS):
        return schema
    return _drop_ref_siblings(schema)


def _drop_ref_siblings(node: Any) -> Any:
    if isinstance(node, list):
        return [_drop_ref_siblings(v) for v in node]
    if not isinstance(node, dict):
        return node
    if isinstance(node.get("$ref"), str):
        node = {k: v for k, v in node.items() if k in _REF_KEPT_SIBLINGS or k == "$schema"}
    return {k: (v if k in _VALUE_KEYS else _drop_ref_siblings(v)) for k, v in node.items()}


def regex_source(pattern: str, parse: Callable[[str], Any] = str) -> GrammarSource:
    if not isinstance(pattern, str):
        raise SchemaError(f"a regex must be a string, got {type(pattern).__name__}; pass Regex('...')")
    grammar = llguidance.LLMatcher.grammar_from_regex(pattern)
    return GrammarSource("regex", "regex:" + pattern, grammar, parse=parse, pattern=pattern)


def lark_source(definition: str) -> GrammarSource:
    if isinstance(definition, str):  # anything else: llguidance's own TypeError, as before
        refuse_special_tokens(
            definition
        )  # the engine cannot decode through control tokens (grammars/special_tokens.py)
    return GrammarSource("lark", "lark:" + definition, llguidance.LLMatcher.grammar_from_lark(definition))


def choice_source(values: dict[str, Any]) -> GrammarSource:
    """One of the texts of `values` (text -> the value the parser returns)."""
    if not values:
        raise SchemaError("an empty list of choices allows no output; give at least one choice")
    texts = list(values)
    # One lexeme (an alternation regex), not one Lark alternative per choice: llguidance's parser
    # refuses a row of more than 2,000 items mid-decode, its lexer takes any number.
    regex = "|".join(_regex_literal(t) for t in texts)
    return GrammarSource(
        "choice",
        "choice:" + json.dumps(texts, ensure_ascii=False),
        llguidance.LLMatcher.grammar_from_regex(regex),
        parse=_choice_parser(values),
    )


def choices_of(items: list | tuple, what: str, text: Callable[[Any], str]) -> dict[str, Any]:
    """text -> value for literal choices; refuses two values with the same text (ambiguous parse)."""
    values: dict[str, Any] = {}
    for item in items:
        key = text(item)
        if key in values and values[key] is not item and values[key] != item:
            raise SchemaError(
                f"{what}: {values[key]!r} and {item!r} are both written {key!r}, so the output could "
                "not say which was chosen; keep one of them"
            )
        values[key] = item
    return values


def _choice_parser(values: dict[str, Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if text not in values:
            raise ValueError(f"{text!r} is none of the choices {sorted(values)}")
        return values[text]

    return parse


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    """`text` as a regex matching exactly it (Rust regex syntax: metacharacters escaped)."""
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)


def grammar_source(spec: Any) -> GrammarSource:
    """Reduce any accepted spec to a GrammarSource; raise SchemaError for anything else."""
    if isinstance(spec, Regex):
        return regex_source(spec.pattern)
    if isinstance(spec, CFG):
        return lark_source(spec.definition)
    if isinstance(spec, dict | bool):
        return json_schema_source(spec)
    if isinstance(spec, list | tuple):
        if not all(isinstance(c, str) for c in spec):
            raise SchemaError("choices must be strings; use typing.Literal for mixed literal values")
        return choice_source(choices_of(spec, "choices", str))
    if typing.get_origin(spec) is typing.Literal:
        return choice_source(choices_of(typing.get_args(spec), repr(spec), _literal_text))
    if isinstance(spec, type) and issubclass(spec, enum.Enum):
        return choice_source(choices_of(list(spec), spec.__name__, lambda m: _literal_text(m.value)))
    if _is_outlines(spec):
        return _outlines_source(spec)
    if isinstance(spec, str):
        raise SchemaError(
            "a bare string is ambiguous as an output spec; wrap it: Regex(...), CFG(...), "
            "or pass a JSON schema as a dict"
        )
    if _is_pydantic_model(spec):
        return json_schema_source(_pydantic_schema(spec), spec.model_validate_json)
    if _is_structured_type(spec):
        return json_schema_source(_pydantic_schema(spec), _type_adapter_parser(spec))
    if isinstance(spec, type) and spec in SCALARS:
        scalar = SCALARS[spec]
        return regex_source(scalar.regex, scalar.parse)
    if spec is str:
        return _outlines_source(spec)
    raise SchemaError(
        f"unsupported output spec {spec!r}; use a pydantic model, a JSON-schema dict, "
        "Regex, CFG, typing.Literal, an Enum, a list of choices or an outlines type"
    )


def _literal_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else str(value)


def _is_pydantic_model(spec: Any) -> bool:
    import pydantic

    return isinstance(spec, type) and issubclass(spec, pydantic.BaseModel)


def _is_structured_type(spec: Any) -> bool:
    import dataclasses

    if isinstance(spec, type) and (dataclasses.is_dataclass(spec) or typing.is_typeddict(spec)):
        return True
    return typing.get_origin(spec) in (list, dict, tuple, typing.Union)


def _pydantic_schema(spec: Any) -> dict:
    import pydantic

    generator = _closed_objects_generator()
    try:
        if _is_pydantic_model(spec):
            return spec.model_json_schema(schema_generator=generator)
        return pydantic.TypeAdapter(spec).json_schema(schema_generator=generator)
    except pydantic.PydanticUserError as err:
        if err.code == "typed-dict-version":
            raise SchemaError(
                f"{spec!r} uses typing.TypedDict, which pydantic reads only on Python >= 3.12; "
                "define it with `from typing_extensions import TypedDict`"
            ) from err
        raise SchemaError(f"pydantic cannot describe {spec!r} as JSON ({err.message}); fix the type") from err


def _type_adapter_parser(spec: Any) -> Callable[[str], Any]:
    import pydantic

    adapter = pydantic.TypeAdapter(spec)  # built once: compile already proved pydantic reads it
    return adapter.validate_json


@functools.cache
def _closed_objects_generator() -> type:
    """pydantic's JSON-schema generator, with classes closed unless they say `extra="allow"`."""
    from pydantic.json_schema import GenerateJsonSchema

    class ClosedObjects(GenerateJsonSchema):
        def _update_class_schema(self, json_schema: Any, cls: type[Any], config: Any) -> None:
            super()._update_class_schema(json_schema, cls, config)
            # pydantic sets the key for extra="allow"/"forbid" and typed extras; only the
            # unsaid (or "ignore") case is left, and only object schemas take the keyword.
            if json_schema.get("type") == "object" and "additionalProperties" not in json_schema:
                json_schema["additionalProperties"] = False

    return ClosedObjects


def _is_outlines(spec: Any) -> bool:
    return type(spec).__module__.startswith("outlines")


def _outlines_source(spec: Any) -> GrammarSource:
    from outlines.types import dsl

    if isinstance(spec, dsl.JsonSchema):
        return json_schema_source(spec.schema)
    if isinstance(spec, dsl.Regex):
        return regex_source(spec.pattern)
    if isinstance(spec, dsl.CFG):
        return lark_source(spec.definition)
    term = spec if isinstance(spec, dsl.Term) else dsl.python_types_to_terms(spec)
    if isinstance(term, dsl.JsonSchema):
        return json_schema_source(term.schema)
    if _contains_json_schema(term, dsl):
        # outlines would turn the schema into a regex that ignores numeric bounds: refuse instead.
        raise SchemaError(
            f"{spec!r} mixes a JSON schema into a regex term; express the whole output "
            "as one JSON schema (anyOf) or one Regex"
        )
    return regex_source(dsl.to_regex(term))


def _contains_json_schema(term: Any, dsl: Any) -> bool:
    if isinstance(term, dsl.JsonSchema):
        return True
    children = getattr(term, "__dict__", {}).values()
    for child in children:
        items = child if isinstance(child, list | tuple) else [child]
        if any(isinstance(c, dsl.Term) and _contains_json_schema(c, dsl) for c in items):
            return True
    return False
