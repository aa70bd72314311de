"""foveal.grammars: output specs compiled into token-mask automata."""

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.grammars")
