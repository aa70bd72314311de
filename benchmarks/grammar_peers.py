"""Compile and mask times of foveal's grammar layer (llguidance) next to xgrammar and outlines-core.

    python -m benchmarks.grammar_peers [--per-subset 10] [--quick] [--out out/benchmarks/grammar_peers.json]

For the first `--per-subset` schemas of each shared JSONSchemaBench subset (Github_trivial,
Github_easy, Github_medium in /work/shared/conformance/jsonschemabench), with SmolLM2's 49,152-token
vocabulary, each engine:
  - compiles the schema (caches off or cleared; seconds per schema, p50/p90/max), or refuses it;
  - walks the first valid instance of the schema's tests, serialized compactly (", " and ": ", keys
    in schema order: the style all three are asked for), filling the next-token mask before each
    token (microseconds per mask, p50/p99) and committing the token.
Engines: foveal.grammars (llguidance, what foveal decodes with); xgrammar (`compile_json_schema`,
`fill_next_token_bitmask`); outlines-core (`build_regex_from_schema` + `Index`, `Guide.write_mask_into`),
its vocabulary built the way outlines builds it. xgrammar and outlines-core are only in the `bench`
extra; a missing one is reported as missing (with the install command), never skipped silently.
Differences of meaning matter as much as the times: the `refused` and `walk rejected` counts say
which schemas an engine does not compile or whose valid instance it does not accept.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import write_json
from foveal import grammars
from foveal.grammars.compiler import AUTOMATA
from foveal.grammars.conformance.bench import files
from foveal.grammars.conformance.feed import EOS, serializations
from foveal.testing import SMOLLM2_TOKENIZER

SUBSETS = ("Github_trivial", "Github_easy", "Github_medium")
INSTALL = "pip install -e '.[bench]' -c constraints.txt"


class Refused(Exception):
    """The engine does not compile this schema (its own exception is the message)."""


class Rejected(Exception):
    """The engine refuses a token of a valid instance."""


# ---- engines: compile(schema) -> walker; walker(ids, mask_times) walks the tokens ----------------------------


def foveal_engine(tok: Any) -> Callable:
    grammars.compile({"type": "string"}, tok, eos_token_id=EOS).matcher()  # the tokenizer's tables, once

    def compile_schema(schema: dict) -> Callable:
        AUTOMATA.clear()
        try:
            automaton = grammars.compile(schema, tok, eos_token_id=EOS)
            automaton.matcher()  # the first matcher finishes llguidance's lazy work: part of compiling
        except grammars.SchemaError as e:
            raise Refused(str(e)) from e

        def walk(ids: list[int], times: list[float]) -> None:
            m = automaton.matcher()
            bm = grammars.allocate_bitmask(1, automaton.vocab_size)
            for t in ids:
                start = time.perf_counter()
                m.fill_mask(bm, 0)
                times.append(time.perf_counter() - start)
                try:
                    m.commit(t)
                except grammars.GrammarViolation as e:
                    raise Rejected(str(e)) from e

        return walk

    return compile_schema


def xgrammar_engine(hf_tok: Any) -> Callable:
    import torch
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=len(hf_tok))

    def compile_schema(schema: dict) -> Callable:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            compiled = compiler.compile_json_schema(
                json.dumps(schema), separators=(", ", ": "), strict_mode=True
            )
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses for unsupported input
            raise Refused(f"{type(e).__name__}: {e}") from e

        def walk(ids: list[int], times: list[float]) -> None:
            matcher = xgr.GrammarMatcher(compiled)
            bm = xgr.allocate_token_bitmask(1, info.vocab_size)
            with torch.inference_mode():
                for t in ids:
                    start = time.perf_counter()
                    matcher.fill_next_token_bitmask(bm)
                    times.append(time.perf_counter() - start)
                    if not matcher.accept_token(t):
                        raise Rejected(f"token {t}")

        return walk

    return compile_schema


def outlines_core_engine(hf_tok: Any) -> Callable:
    import numpy as np
    from outlines.backends.outlines_core import OutlinesCoreBackend
    from outlines.models.transformers import TransformerTokenizer
    from outlines_core import Guide, Index
    from outlines_core.json_schema import build_regex_from_schema

    tok = TransformerTokenizer(hf_tok)
    vocabulary = OutlinesCoreBackend.create_outlines_core_vocabulary(
        tok.get_vocab(), tok.eos_token_id, tok.eos_token, tok.convert_token_to_string
    )
    words = (len(hf_tok) + 31) // 32

    def compile_schema(schema: dict) -> Callable:
        try:
            index = Index(build_regex_from_schema(json.dumps(schema), r" ?"), vocabulary)
        except (
            Exception
        ) as e:  # outlines-core raises ValueError/TypeError/its own errors on unsupported input
            raise Refused(f"{type(e).__name__}: {e}") from e

        def walk(ids: list[int], times: list[float]) -> None:
            guide = Guide(index)
            mask = np.zeros(words, dtype=np.int32)
            for t in ids:
                start = time.perf_counter()
                guide.write_mask_into(mask.ctypes.data, mask.size, 4)
                times.append(time.perf_counter() - start)
                try:
                    guide.advance(t, return_tokens=False)
                except Exception as e:  # ValueError: the token is not allowed
                    raise Rejected(str(e)) from e

        return walk

    return compile_schema


def engines(tok: Any, hf_tok: Any) -> tuple[dict[str, Callable], dict[str, str]]:
    """The engines that import here, and a message for each one that does not."""
    found: dict[str, Callable] = {"foveal (llguidance)": foveal_engine(tok)}
    missing: dict[str, str] = {}
    for name, make in (("xgrammar", xgrammar_engine), ("outlines-core", outlines_core_engine)):
        try:
            found[name] = make(hf_tok)
        except ImportError as e:
            missing[name] = f"{name} is not installed ({e}); install the bench extra: {INSTALL}"
    return found, missing


# ---- the benchmark -------------------------------------------------------------------------------------------


def schema_files(per_subset: int, subsets: tuple[str, ...] = SUBSETS) -> list[Path]:
    """The first `per_subset` schema files of each subset of the corpus in ../shared/conformance."""
    return [path for subset in subsets for path in files(subset)[:per_subset]]


def cases(tok: Any, paths: list[Path]) -> list[tuple[str, dict, list[int]]]:
    """(subset/file name, schema, token ids of its first valid instance) for each JSONSchemaBench file."""
    out = []
    for path in paths:
        doc = json.loads(path.read_text())
        valid = [t["data"] for t in doc.get("tests", []) if t.get("valid")]
        text = serializations(valid[0], doc["schema"])[0] if valid else None
        ids = tok.encode(text, add_special_tokens=False).ids if text is not None else []
        out.append((f"{path.parent.name}/{path.name}", doc["schema"], ids))
    return out


def measure(engine: Callable, schemas: list[tuple[str, dict, list[int]]]) -> dict:
    compile_s, first_s, mask_s, refused, rejected, walked = [], [], [], [], [], 0
    for name, schema, ids in schemas:
        start = time.perf_counter()
        try:
            walk = engine(schema)
        except Refused as e:
            refused.append(f"{name}: {str(e)[:120]}")
            continue
        compile_s.append(time.perf_counter() - start)
        if not ids:
            continue
        times: list[float] = []
        try:
            walk(ids, times)
            walked += 1
        except Rejected:
            rejected.append(name)
        first_s += times[:1]
        mask_s += times[1:]
    return {
        "schemas": len(schemas),
        "compiled": len(compile_s),
        "refused": refused,
        "walked": walked,
        "walk_rejected": rejected,
        "compile_ms": summary(compile_s, 1e3, (50, 90, 100)),
        "first_mask_us": summary(first_s, 1e6, (50, 100)),  # lazy work left over from compile shows here
        "mask_us": summary(mask_s, 1e6, (50, 99)),  # every later mask
        "mask_steps": len(mask_s),
    }


def summary(values: list[float], scale: float, qs: tuple[int, ...]) -> dict:
    if not values:
        return {}
    arr = np.asarray(values) * scale
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs} | {"mean": float(arr.mean())}


def run(paths: list[Path]) -> dict:
    """Every engine on the JSONSchemaBench files `paths` (`schema_files` picks them from the corpus)."""
    import transformers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(SMOLLM2_TOKENIZER / "tokenizer.json"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER)
    found, missing = engines(tok, hf_tok)
    schemas = cases(tok, paths)
    results = {name: measure(engine, schemas) for name, engine in found.items()}
    return {"files": [name for name, _, _ in schemas], "results": results, "missing": missing}


def print_table(report: dict) -> None:
    subsets = sorted({name.split("/")[0] for name in report["files"]})
    print(
        f"grammar engines, SmolLM2 vocabulary, {len(report['files'])} JSONSchemaBench schemas ({', '.join(subsets)})"
    )
    head = (
        f"{'engine':<20} {'compiled':>8} {'refused':>7} {'walk rej':>8} | {'compile ms p50':>14} {'p90':>8} "
        f"{'max':>8} | {'1st mask µs p50':>15} {'max':>8} | {'mask µs p50':>11} {'p99':>7}"
    )
    print(head)
    print("-" * len(head))
    for name, r in report["results"].items():
        c, f, m = r["compile_ms"], r["first_mask_us"], r["mask_us"]
        print(
            f"{name:<20} {r['compiled']:>8} {len(r['refused']):>7} {len(r['walk_rejected']):>8} | "
            f"{c.get('p50', float('nan')):>14.2f} {c.get('p90', float('nan')):>8.1f} {c.get('p100', float('nan')):>8.1f} | "
            f"{f.get('p50', float('nan')):>15.1f} {f.get('p100', float('nan')):>8.0f} | "
            f"{m.get('p50', float('nan')):>11.1f} {m.get('p99', float('nan')):>7.1f}"
        )
    for name, message in report["missing"].items():
        print(f"{name:<20} MISSING: {message}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--per-subset", type=int, default=None, help="schemas per subset (default 10; quick 2)"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="out/benchmarks/grammar_peers.json")
    args = parser.parse_args(argv)
    report = run(schema_files(args.per_subset or (2 if args.quick else 10)))
    print_table(report)
    print(f"wrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
