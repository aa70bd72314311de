"""Pipelined vs blocking decode throughput of foveal.engine, with the gain the pipeline should reach.

    python -m benchmarks.pipeline [--out out/benchmarks/pipeline.json] [--quick] [--cpus 0]

For each forward time F (the fake runner sleeps ~1 ms or ~5 ms, standing in for accelerator time),
each number of concurrent streams (1, 8, 32, 64) and unconstrained / constrained (a real
foveal.grammars regex automaton), it runs the same greedy workload in blocking and in pipelined
mode and reports:
  - tokens/s in each mode and the measured gain (pipelined / blocking);
  - the ideal gain (F + S + B) / (F + S), from the blocking run's measured forward F, sample S
    (sampler + host copy, device side) and host bookkeeping B (launch + commit + finalize);
  - gain / ideal, and the device's idle fraction of wall time in each mode.
The workload uses a 512-token byte-level BPE tokenizer trained here (text is detokenized and stop
checks run, as in real use). Numbers depend on the machine and on its load; the JSON keeps them all,
with the load average at the start and the end. Each run is warmed up with requests of its own kind
(constrained or not), so one-time costs (llguidance's lazily built lexer, a mask kernel compiled on
first use, which cost ~4 s while the sampler had one) are not timed.

Reading the numbers on a CPU machine:
  - B is scheduler-thread time per step in blocking mode (the engine's phase timers). It includes
    waking the idle device thread at each launch, which only blocking mode pays; it leaves out the
    hand-off latency of every wait (the device finishes, the scheduler thread runs again), which
    blocking mode also pays each step and the pipeline hides. So the gain can exceed the "ideal".
  - F is the fake forward's job time: its own compute, the sleep standing in for the accelerator,
    and the time the OS takes to run the device thread again after the sleep. That last part grows
    with host load: in pipelined mode the scheduler thread runs during every forward, and others'
    work on a shared machine competes too. `F pipe` shows it. The ideal uses blocking F, so
    gain / ideal below 1 can be the stand-in device slowing down, not the pipeline stalling; the
    pipelined idle fraction (device job time over wall time) is the measure of the pipeline itself.
  - A job waiting for the GIL or a core counts as busy device time, as it would on an accelerator
    that was handed the work.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from benchmarks import write_json
from foveal import grammars
from foveal.engine import Engine, EngineConfig, FinishReason, Request, SamplingParams
from foveal.testing import FakeRunner

VOCAB, EOS = 512, 0
CORPUS = ["the quick brown fox jumps over the lazy dog", "a red circle left of a blue square"] * 50
PATTERN = r"([a-z]+ )*[a-z]+"  # ends only where the model picks EOS, which the fake runner never does
PROMPT_LEN, PAGE_SIZE = 8, 16


def pages_for(streams: int, tokens: int) -> int:
    """KV pages for every stream at once (with 128 tokens a fixed 1,024 fitted 64 streams; with 256
    only 60 did, and the last 4 ran alone afterwards: another workload than the table says)."""
    return max(streams, 1) * -(-(PROMPT_LEN + tokens) // PAGE_SIZE)


def make_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def decode(runner, tokenizer, automaton, streams: int, pipelined: bool, tokens: int) -> tuple[dict, list]:
    """One timed greedy run of `streams` requests of `tokens` tokens each on `runner`: the engine's
    stats (with `wall_s`) and every stream's token ids, checked to be of the full length."""
    config = EngineConfig(
        pipelined=pipelined,
        max_batch=max(streams, 1),
        eos_token_ids=(EOS,),
        page_size=PAGE_SIZE,
        num_pages=pages_for(streams, tokens),
        max_model_len=PROMPT_LEN + tokens,
        fill_masks=grammars.fill_masks,
    )
    with Engine(runner, tokenizer, config) as engine:
        warm_up(engine, automaton, streams)
        requests = [
            Request(
                [1 + (i * 7 + j) % 200 for j in range(PROMPT_LEN)],
                SamplingParams(max_tokens=tokens, ignore_eos=True),
                automaton.matcher() if automaton is not None else None,
            )
            for i in range(streams)
        ]
        t0 = time.perf_counter()
        outs = engine.generate(requests, timeout=600)
        wall = time.perf_counter() - t0
        stats = engine.stats()
    token_ids = [o.token_ids for o in outs]
    # EOS is ignored, so a stream ends early only where its grammar allows EOS and the model picks it
    # (the fake runner never does; a real model may): that is an outcome, a failure is not.
    failed = [o for o in outs if o.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outs)} streams failed: {failed[0].finish_reason} {failed[0].error}")
    stats["wall_s"] = wall
    return stats, token_ids


def run(
    tokenizer, automaton, forward_s: float, streams: int, pipelined: bool, tokens: int, device: str = "cpu"
) -> tuple[dict, list]:
    """`decode` on a fake runner whose forward takes `forward_s`."""
    runner = FakeRunner(vocab_size=VOCAB, delay_s=forward_s, seed=0, boost={EOS: -100.0}, device=device)
    return decode(runner, tokenizer, automaton, streams, pipelined, tokens)


def warm_up(engine: Engine, automaton, streams: int) -> None:
    """A short run of the same kind of requests (constrained or not) before timing, so that
    one-time costs of that path stay out of the measurement."""
    matcher = (lambda: automaton.matcher()) if automaton is not None else (lambda: None)
    engine.generate(
        [Request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), matcher()) for _ in range(streams)]
    )
    assert engine.wait_idle(60)
    engine.reset_stats()


def save_tiny_llama(tokenizer, folder: str) -> None:
    """Write a random Llama (4 layers, width 256, seed 0) built from a config, with `tokenizer`, to `folder`."""
    import transformers as tf

    hf_tok = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=EOS,
        pad_token_id=EOS,
        bos_token_id=None,
        architectures=["LlamaForCausalLM"],
    )
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    hf_tok.save_pretrained(folder)


def tiny_llama(tokenizer, folder: str):
    """The random Llama of `save_tiny_llama`, loaded through foveal.engine.models."""
    from foveal import families

    save_tiny_llama(tokenizer, folder)
    return families.load(folder, device="cpu")


def run_real(loaded, automaton, streams: int, pipelined: bool, tokens: int) -> tuple[dict, list]:
    """`decode` on a loaded model (`foveal.engine.models.load`) with its own tokenizer."""
    return decode(loaded.runner, loaded.tokenizer, automaton, streams, pipelined, tokens)


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def measure(
    tokenizer, automaton, forward_s: float, streams: int, tokens: int, repeat: int, real=None
) -> dict:
    """Blocking and pipelined runs interleaved `repeat` times (the machine's load drifts); medians.
    `real`: a loaded model to run instead of the fake runner (forward_s is then ignored).
    Every run is greedy on the same requests, so every run must decode the same tokens (DESIGN
    invariant 1: pipelined == blocking); a run that does not raises instead of being measured."""
    runs = {False: [], True: []}
    first_tokens = None
    for _ in range(repeat):
        for pipelined in (False, True):
            if real is not None:
                stats, token_ids = run_real(real, automaton, streams, pipelined, tokens)
            else:
                stats, token_ids = run(tokenizer, automaton, forward_s, streams, pipelined, tokens)
            if first_tokens is None:
                first_tokens = token_ids
            elif token_ids != first_tokens:
                mode = "pipelined" if pipelined else "blocking"
                raise RuntimeError(
                    f"a {mode} run decoded other tokens than the first blocking run ({streams} streams, "
                    f"{'constrained' if automaton is not None else 'unconstrained'}): greedy decoding must be "
                    "token-identical in pipelined and blocking mode"
                )
            runs[pipelined].append(stats)
    blocking, pipelined = median_run(runs[False]), median_run(runs[True])
    f, s, b = blocking["forward_ms"], blocking["sample_ms"], blocking["host_ms_per_step"]
    ideal = (f + s + b) / (f + s)
    gain = pipelined["tokens_per_s"] / blocking["tokens_per_s"]
    return {
        "forward_target_ms": "real" if real is not None else forward_s * 1e3,
        "streams": streams,
        "constrained": automaton is not None,
        "F_ms": f,
        "S_ms": s,
        "B_ms": b,
        "ideal_gain": ideal,
        "ideal_gain_host_bound": (f + s + b) / max(f + s, b),  # the bound when B > F + S
        "gain": gain,
        "gain_over_ideal": gain / ideal,
        "blocking_tok_s": blocking["tokens_per_s"],
        "pipelined_tok_s": pipelined["tokens_per_s"],
        "blocking_idle": 1 - blocking["device_busy_fraction"],
        "pipelined_idle": 1 - pipelined["device_busy_fraction"],
        "pipelined_B_ms": pipelined["host_ms_per_step"],
        "pipelined_F_ms": pipelined["forward_ms"],  # the CPU stand-in's forward under host load
        "raw": {"blocking": blocking, "pipelined": pipelined},
    }


def print_row(label: str, r: dict) -> None:
    print(
        f"{label:>4} {r['streams']:>7} {'yes' if r['constrained'] else 'no':>7} | "
        f"{r['F_ms']:>5.2f} {r['S_ms']:>5.2f} {r['B_ms']:>5.2f} {r['pipelined_F_ms']:>6.2f} | "
        f"{r['blocking_tok_s']:>11.0f} {r['pipelined_tok_s']:>10.0f} | "
        f"{r['gain']:>5.2f} {r['ideal_gain']:>5.2f} {r['gain_over_ideal']:>7.2f} | "
        f"{r['blocking_idle']:>8.1%} {r['pipelined_idle']:>9.1%}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="out/benchmarks/pipeline.json")
    parser.add_argument("--tokens", type=int, default=128, help="tokens decoded per stream")
    parser.add_argument("--repeat", type=int, default=5, help="runs per mode; the median is reported")
    parser.add_argument("--quick", action="store_true", help="one forward time, 8 streams (smoke run)")
    parser.add_argument(
        "--cpus",
        type=lambda text: {int(c) for c in text.split(",")},
        help="pin to these CPUs, e.g. 0: scheduler, device stand-in and mask threads share one core "
        "(the host-time headroom test; more repeatable than whatever load others put on the machine)",
    )
    args = parser.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)
    torch.set_num_threads(1)  # the engine's device thread and the scheduler share a small CPU
    load_start = os.getloadavg()[0]
    tokenizer = make_tokenizer()
    automaton = grammars.compile(grammars.Regex(PATTERN), tokenizer, eos_token_id=EOS, vocab_size=VOCAB)
    forwards = [0.001] if args.quick else [0.001, 0.005]
    stream_counts = [8] if args.quick else [1, 8, 32, 64]
    rows = []
    header = (
        f"{'F':>4} {'streams':>7} {'grammar':>7} | {'F ms':>5} {'S ms':>5} {'B ms':>5} {'F pipe':>6} | "
        f"{'block tok/s':>11} {'pipe tok/s':>10} | {'gain':>5} {'ideal':>5} {'g/ideal':>7} | "
        f"{'idle blk':>8} {'idle pipe':>9}"
    )
    print(header)
    print("-" * len(header))
    for forward_s in forwards:
        for constrained in (False, True):
            for streams in stream_counts:
                r = measure(
                    tokenizer,
                    automaton if constrained else None,
                    forward_s,
                    streams,
                    args.tokens,
                    args.repeat,
                )
                rows.append(r)
                print_row(f"{forward_s * 1e3:>3.0f}m", r)
    if not args.quick:  # a real model: the tiny random Llama through foveal.engine.models (eager, CPU)
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            loaded = tiny_llama(tokenizer, folder)
            for constrained in (False, True):
                for streams in (8, 32):
                    r = measure(
                        tokenizer,
                        automaton if constrained else None,
                        0.0,
                        streams,
                        32,
                        args.repeat,
                        real=loaded,
                    )
                    rows.append(r)
                    print_row("real", r)
    by_key = {(r["forward_target_ms"], r["streams"], r["constrained"]): r for r in rows}
    for r in rows:
        if r["constrained"]:
            free = by_key[(r["forward_target_ms"], r["streams"], False)]
            r["constrained_gain_over_unconstrained"] = r["gain"] / free["gain"]
    meta = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": {"start": load_start, "end": os.getloadavg()[0]},  # others' work on the machine
        "pinned_cpus": sorted(args.cpus) if args.cpus else None,
        "tokens_per_stream": args.tokens,
        "repeat": args.repeat,
    }
    out = write_json(args.out, {"meta": meta, "rows": rows})
    print(
        "\nconstrained gain / unconstrained gain: "
        + ", ".join(
            f"F={r['forward_target_ms']}ms x{r['streams']}: {r['constrained_gain_over_unconstrained']:.2f}"
            for r in rows
            if r["constrained"]
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
