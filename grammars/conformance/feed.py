"""Feeding a text through an automaton token by token, and the canonical serialization of instances.

A verdict is "accept" when every token of the tokenized text is allowed in turn and the grammar
accepts at the end (EOS allowed), else "reject". Instances are serialized in the grammar's style
(compact separators, raw UTF-8) with object keys in the schema's property order, because the
grammar emits properties in that order; the order is recovered best-effort (local $ref, allOf /
anyOf / oneOf / if-then-else branches).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..automaton import Automaton
from ..bitmask import allocate_bitmask
from ..errors import GrammarViolation

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
CONFORMANCE = SHARED / "conformance"
SMOLLM2 = SHARED / "tokenizers" / "smollm2"
EOS = 2


def load_tokenizer() -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(SMOLLM2 / "tokenizer.json"))


def fresh_automaton(spec: Any, tok: Any) -> Automaton:
    """`spec` compiled anew, bypassing the cache: its shared llguidance lexer is cold and unused,
    so a verdict on it cannot depend on what other matchers did before."""
    from ..automaton import compile_template
    from ..specs import grammar_source
    from ..tokenizer import tokenizer_handle

    handle = tokenizer_handle(tok, eos_token_id=EOS)
    source = grammar_source(spec)
    template = compile_template(handle, source)
    return Automaton(
        key="fresh", kind=source.kind, grammar=source.grammar, tokenizer=handle, template=template
    )


def feed(automaton: Automaton, token_ids: list[int], mask_times: list[float] | None = None) -> bool:
    """True when the automaton accepts exactly this token sequence (then EOS).

    With `mask_times` the mask is filled (and timed) before each commit; without, tokens are only
    committed. The verdict is the same either way (matcher.py, invariant 5).
    """
    m = automaton.matcher()
    bitmask = allocate_bitmask(1, automaton.vocab_size) if mask_times is not None else None
    for t in token_ids:
        if bitmask is not None:
            assert mask_times is not None  # the bitmask exists only with mask_times
            start = time.perf_counter()
            m.fill_mask(bitmask, 0)
            mask_times.append(time.perf_counter() - start)
        try:
            m.commit(t)
        except GrammarViolation:
            return False
    return m.is_accepting()


def serialize(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(", ", ": "))


def serializations(data: Any, schema: Any) -> list[str]:
    """The instance in schema property order, and as given (if that differs)."""
    texts = [serialize(reorder(data, schema, schema, 0)), serialize(data)]
    return texts[:1] if texts[0] == texts[1] else texts


def reorder(data: Any, schema: Any, root: Any, depth: int) -> Any:
    if depth > 50:
        return data
    schemas = _branches(schema, root, 0)
    if isinstance(data, dict):
        order: list[str] = []
        props: dict[str, Any] = {}
        for s in schemas:
            for key, sub in (
                (s.get("properties") or {}).items() if isinstance(s.get("properties"), dict) else ()
            ):
                if key not in props:
                    order.append(key)
                    props[key] = sub
        keys = [k for k in order if k in data] + [k for k in data if k not in props]
        return {k: reorder(data[k], props.get(k), root, depth + 1) for k in keys}
    if isinstance(data, list):
        items = next((s["items"] for s in schemas if isinstance(s.get("items"), dict)), None)
        prefix: list = next((s["prefixItems"] for s in schemas if isinstance(s.get("prefixItems"), list)), [])
        return [
            reorder(v, prefix[i] if i < len(prefix) else items, root, depth + 1) for i, v in enumerate(data)
        ]
    return data


def _branches(schema: Any, root: Any, depth: int) -> list[dict]:
    if not isinstance(schema, dict) or depth > 20:
        return []
    out = [schema]
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out += _branches(_resolve(root, ref), root, depth + 1)
    for key in ("allOf", "anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out += _branches(sub, root, depth + 1)
    for key in ("then", "else"):
        out += _branches(schema.get(key), root, depth + 1)
    return out


def _resolve(root: Any, ref: str) -> Any:
    node = root
    for part in ref[1:].split("/")[1:] if ref.startswith("#/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if ref.startswith("#/") or ref == "#" else None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]
