"""`settle()`: the heap a model load leaves, taken out of the garbage collector's full collections.

PROBLEM
    A full collection (generation 2) visits every container object of the process, with the GIL
    held. After `foveal serve` has loaded the embedded model that is about 400,000 objects (torch,
    transformers, the tokenizer, the app): tenths of a second (docs/performance.md), during which the event
    loop (and /health) waits, whichever thread the collection ran on. The collector starts one once
    the objects that survived into generation 2 since the last reach a quarter of those it holds; a
    load leaves that many, so the first request that allocated a few thousand containers (a
    500,000-point `spatial_refs` body, parsed up to its 20,000th value) paid for it, and /health
    waited as long. In the test process, whose collector state is another, the same request did not.
SOLUTION
    When the app's loader has returned, collect once (the load's own garbage) and `gc.freeze()` the
    rest: it moves to the permanent generation, which no collection visits. Full collections then
    visit what was made since (what requests keep: caches, compiled grammars), not the libraries
    and the model. Objects frozen are still freed by reference counting; only a cycle among them
    waits for `thaw()`, which the app calls when it closes the model it loaded.
INVARIANTS
    - A model the app loaded is settled before any model route sees it (and /health says "ok").
    - A model the caller gave `create_app` is not: the caller owns that process's collector.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Collect the load's garbage, then freeze every object left (module docstring). Holds the GIL
    for one full collection (tenths of a second for the embedded model): call it while loading."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Give the frozen objects back to the collector (the app closed the model it settled)."""
    gc.unfreeze()
