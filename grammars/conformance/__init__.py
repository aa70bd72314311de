"""Conformance runner: the grammar layer against real-world corpora in ../shared/conformance.

    python -m foveal.grammars.conformance [--suite jsts|jsonschemabench|cases|soundness|all] [--json out.json]

Suites (see each module): `jsts` (JSON-Schema-Test-Suite draft2020-12 and draft7, a table per keyword),
`jsonschemabench` (compile coverage, false accepts/rejects, compile and mask time, side by side with
llguidance's own baseline), `cases` (accept/reject sets of other engines' grammar tests),
`soundness` (random walks under the mask over compiled JSONSchemaBench schemas, validated with
jsonschema). The SmolLM2 tokenizer in ../shared/tokenizers/smollm2 is the vocabulary.
"""
