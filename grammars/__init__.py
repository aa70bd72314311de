"""foveal.grammars: output specs compiled into token-mask automata.

    a = grammars.compile(spec, tokenizer)   # Automaton, cached; raises SchemaError before decoding
    m = a.matcher()                         # one sequence: commit / fill_mask / is_terminated / rollback
    grammars.fill_masks(matchers, bitmask)  # a whole decoding step in one native call
    grammars.set_mask_threads(n)            # its thread pool (or $FOVEAL_MASK_THREADS)
    grammars.set_compile_budget(grammars.CompileBudget(max_grammar_bytes=...))  # what a compile may cost

Specs: pydantic models, JSON-schema dicts, Regex, CFG (Lark), typing.Literal, Enum, lists of
choices, outlines output types, and the spatial shapes of `grammars.spatial` (their location-token format:
`grammars.locations`). Mechanisms a family's own answer format builds on: `grammars.automaton.lark_automaton`
(a spec's Lark text), `grammars.integer_boxes` (integer boxes with x1 < x2, y1 < y2); a chat reply's grammar
(thinking, output type, tool calls): `grammars.tool_calls`. Built on llguidance, which no other package imports.
"""

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.grammars")

from . import locations, spatial  # noqa: E402
from .automaton import Automaton  # noqa: E402
from .batch import fill_masks  # noqa: E402
from .bitmask import allocate_bitmask, mask_threads, set_mask_threads  # noqa: E402
from .compiler import compile, parser_of  # noqa: E402
from .errors import GrammarLimitError, GrammarViolation, SchemaError  # noqa: E402
from .limits import CompileBudget, compile_budget, set_compile_budget  # noqa: E402
from .matcher import Matcher  # noqa: E402
from .specs import CFG, Regex  # noqa: E402

__all__ = [
    "CFG",
    "Automaton",
    "CompileBudget",
    "GrammarLimitError",
    "GrammarViolation",
    "Matcher",
    "Regex",
    "SchemaError",
    "allocate_bitmask",
    "compile",
    "compile_budget",
    "fill_masks",
    "locations",
    "mask_threads",
    "parser_of",
    "set_compile_budget",
    "set_mask_threads",
    "spatial",
]
