"""`generate(..., output_type=T)`: the parser that turns the constrained text into a value of T.

The grammar layer decides both what text may be generated for an output type and how that text is
read back: `foveal.grammars.compile(T, tokenizer).parse` is the parser (the table of parsers is in
foveal/grammars/specs.py; spatial specs parse to the point / detect result dict). The text is valid
by construction, so a parse failure means the output was cut short (max_tokens): it raises, never
returns a guess.

`output_parser` is the transition path for callers that hold no automaton yet: it resolves the
type through the same single dispatch (`foveal.grammars.compiler.parser_of`), without a tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from foveal.grammars.compiler import parser_of


def output_parser(output_type: Any) -> Callable[[str], Any]:
    """The parser of `generate`'s text for `output_type` (None: the text itself)."""
    if output_type is None:
        return str
    return parser_of(output_type)
