"""Refuse imports of the source folders under their bare names.

The repository's folders `sdk/`, `engine/`, `grammars/`, `vision/` are installed as `foveal`,
`foveal.engine`, `foveal.grammars`, `foveal.vision`. Run from the repository root, Python could still
import `engine` as a top-level package from the working directory; that would create a second copy of
every module (two caches, two registries), so each package refuses it with a message.
"""


def require_foveal_name(name: str, proper: str) -> None:
    if name != proper:
        raise ImportError(f"this folder is the package {proper!r}; use `import {proper}` (not {name!r})")
