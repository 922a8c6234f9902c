"""Where an engine step's host time goes, phase by phase, when someone asks.

`pagedq bench host` and `pagedq bench offline --breakdown` attach a `StepTimings` to an
in-process engine (LLMEngine.set_step_timings): the front opens and closes each step's
record, the core and the runner mark their phases in it; without one, a step pays an
`is None` check per phase. Phases:

- schedule: the scheduler's decisions and the block manager's bookkeeping;
- prepare: the step's inputs (the persistent batch's differences, the packed arrays, the
  host-to-device copy);
- forward: the model (on a GPU, only the launch: the device runs it asynchronously);
- sample: the sampler (launch on a GPU) and the wait for the step's token ids;
- update: the new tokens appended, stop checks, finished requests freed (the core);
- output: detokenization, stop strings, `RequestOutput`s (the front's output processor).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

PHASES = ("schedule", "prepare", "forward", "sample", "update", "output")


@dataclass
class StepRecord:
    num_seqs: int  # sequences with tokens in the step
    num_tokens: int
    decode_only: bool
    seconds: dict[str, float] = field(default_factory=dict)


class StepTimings:
    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self._current: StepRecord | None = None
        self._mark = 0.0

    def begin(self) -> None:
        self._current = StepRecord(0, 0, False)
        self._mark = time.perf_counter()

    def shape(self, num_seqs: int, num_tokens: int) -> None:
        current = self._current
        current.num_seqs, current.num_tokens = num_seqs, num_tokens
        current.decode_only = num_seqs == num_tokens

    def phase(self, name: str) -> None:
        """The time since the last mark goes to `name` (added up if a phase recurs)."""
        now = time.perf_counter()
        seconds = self._current.seconds
        seconds[name] = seconds.get(name, 0.0) + now - self._mark
        self._mark = now

    def end(self) -> None:
        if self._current is not None and self._current.num_seqs:
            self.records.append(self._current)
        self._current = None

    def clear(self) -> None:
        self.records.clear()

    def summary(self, decode_only: bool = True) -> dict:
        """Per phase, the mean microseconds per step and per sequence-step over the
        recorded steps (decode-only ones by default: every sequence one token)."""
        records = [r for r in self.records if r.decode_only or not decode_only]
        if not records:
            return {"steps": 0}
        seq_steps = sum(r.num_seqs for r in records)
        totals = {name: sum(r.seconds.get(name, 0.0) for r in records) for name in PHASES}
        total = sum(totals.values())
        return {
            "steps": len(records),
            "mean_seqs_per_step": seq_steps / len(records),
            "us_per_step": 1e6 * total / len(records),
            "us_per_seq_step": 1e6 * total / seq_steps,
            "median_us_per_step": 1e6 * statistics.median(sum(r.seconds.values()) for r in records),
            "phases_us_per_step": {name: 1e6 * totals[name] / len(records) for name in PHASES},
            "phases_us_per_seq_step": {name: 1e6 * totals[name] / seq_steps for name in PHASES},
        }
