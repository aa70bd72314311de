"""foveal: vision-language models with structured output, on a pipelined inference engine.

The public API (see DESIGN.md): `foveal.load()`, the `Model` facade and its skills, result types,
`foveal.Regex` / `foveal.CFG` output types, and the CLI (`foveal --help`).
"""

from importlib.metadata import PackageNotFoundError, version

from ._guard import require_foveal_name

require_foveal_name(__name__, "foveal")

try:
    __version__ = version("foveal")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
