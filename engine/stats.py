"""Per-step timing of the scheduler and the device, summarized by `Engine.stats()`.

Scheduler phases (launch, commit, finalize, text) are host time on the scheduler thread (`text`:
detokenizing committed tokens, stop strings and stream deltas, done after finalize); `wait` is time
blocked on a step's host copy and is not counted in commit. `active_s` is wall time while the
engine had work. Device time comes from the device (`CpuDevice` measures each job); its idle share
of `active_s` is the pipeline's bubble. `forward_ms` is a one-forward job's mean; a decode burst's
job (several forwards, each sampled: bursts.py) is `burst_ms`, and `burst_steps` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Stats:
    steps: int = 0
    prefill_rows: int = 0
    prefill_steps: int = 0  # launches that carried at least one prefill
    decode_rows: int = 0
    tokens: int = 0  # committed output tokens
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_tokens: int = 0  # ... of which the prefix cache held the K/V (not computed again)
    jumps: int = 0  # jump-forward: rows whose next launch carried forced tokens
    forced_tokens: int = 0  # ... and the output tokens those launches added without a decode step of their own
    final_runs: int = 0  # rows whose forced tokens completed the output: no launch after them (pipeline.py)
    burst_steps: int = 0  # steps that ran several decode sub-steps (bursts.py)
    active_s: float = 0.0
    phase_s: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("launch", "commit", "finalize", "text", "wait"), 0.0)
    )

    def reset(self) -> None:
        fresh = Stats()
        for name in self.__slots__:
            setattr(self, name, getattr(fresh, name))

    def count_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def count_step(self, prefill_rows: int, decode_rows: int) -> None:
        self.steps += 1
        self.prefill_steps += prefill_rows > 0
        self.prefill_rows += prefill_rows
        self.decode_rows += decode_rows

    def summary(self, busy_s: float, job_s: dict[str, float], job_n: dict[str, int]) -> dict:
        steps = max(self.steps, 1)
        busy = min(busy_s, self.active_s)

        def per_job(name: str) -> float:
            return job_s.get(name, 0.0) / max(job_n.get(name, 0), 1)

        host_s = sum(v for k, v in self.phase_s.items() if k != "wait")
        return {
            "steps": self.steps,
            "prefill_rows": self.prefill_rows,
            "prefill_steps": self.prefill_steps,
            "decode_rows": self.decode_rows,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_tokens,
            "prefix_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "jumps": self.jumps,
            "forced_tokens": self.forced_tokens,
            "final_runs": self.final_runs,
            "burst_steps": self.burst_steps,
            "active_s": self.active_s,
            "tokens_per_s": self.tokens / self.active_s if self.active_s else 0.0,
            "phase_ms_per_step": {k: 1e3 * v / steps for k, v in self.phase_s.items()},
            "host_ms_per_step": 1e3 * host_s / steps,
            "forward_ms": 1e3 * per_job("forward"),
            "sample_ms": 1e3 * (per_job("sample") + per_job("copy")),
            "burst_ms": 1e3 * per_job("burst"),  # a decode burst's job: its forwards and their samples (bursts.py)
            "device_busy_s": busy,
            "device_busy_fraction": busy / self.active_s if self.active_s else 0.0,
            "bubble_s": self.active_s - busy,
        }
