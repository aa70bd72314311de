"""foveal: vision-language models with structured output, on a pipelined inference engine.

The public API (docs/skills.md, docs/api): `foveal.load()`, the `Model` facade and its skills, result types,
`foveal.Regex` / `foveal.CFG` output types, and the CLI (`foveal --help`).

    import foveal
    model = foveal.load("/path/to/hf_folder")      # foveal.load() for the embedded model
    model.detect(image, "red circle")              # {"objects": [{"x_min", "y_min", "x_max", "y_max"}]}

Names are imported on first use, so `import foveal` (and `foveal --version`) stays fast: torch and
transformers load with the first `foveal.load`.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ._guard import require_foveal_name

require_foveal_name(__name__, "foveal")

try:
    __version__ = version("foveal")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

_LAZY = {
    "load": "foveal.model",
    "Model": "foveal.model",
    "EncodedImage": "foveal.model",
    "Regex": "foveal.grammars",
    "CFG": "foveal.grammars",
    "SchemaError": "foveal.grammars",
    "ImageError": "foveal.vision",
    "ModelLoadError": "foveal.engine.models",
    "GenerationError": "foveal.errors",
    "Usage": "foveal.results",
    "IncompleteOutputError": "foveal.errors",
    "ModelClosedError": "foveal.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'foveal' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
