"""Online serving metrics, as `vllm bench serve` defines them, from per-request timings.

TTFT: first token's arrival − request sent. TPOT: (e2e − TTFT) / (output tokens − 1), per
request. ITL: the gaps between successive token arrivals, pooled over all requests.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    # time.perf_counter() when the request was sent.
    sent: float
    # Arrival time of each streamed token chunk (one per engine step, normally one token).
    chunk_arrivals: list[float] = field(default_factory=list)
    # When the service's answer to the submission arrived (pagedq's 202; None: not measured).
    accepted: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished is not None

    @property
    def ttft(self) -> float | None:
        return self.chunk_arrivals[0] - self.sent if self.chunk_arrivals else None

    @property
    def e2e(self) -> float:
        assert self.finished is not None
        return self.finished - self.sent

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def inter_token_latencies(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunk_arrivals, self.chunk_arrivals[1:])]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution_ms(values_s: list[float]) -> dict[str, float] | None:
    if not values_s:
        return None
    values = [v * 1000 for v in values_s]
    return {"mean": statistics.fmean(values), "p50": percentile(values, 50), "p99": percentile(values, 99)}


def summarize(timings: list[RequestTiming], duration_s: float) -> dict:
    done = [t for t in timings if t.ok]
    output_tokens = sum(t.output_tokens for t in done)
    # Streamed delta events that brought tokens. A delta carries every token since the
    # last: those of the steps one worker round trip spans, more when the api's relay fell
    # behind and merged a job's waiting deltas. Relay cost goes with events, not tokens.
    events = sum(len(t.chunk_arrivals) for t in done)
    return {
        "requests": len(timings),
        "completed": len(done),
        "failed": len(timings) - len(done),
        "duration_s": duration_s,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_tokens_per_s": output_tokens / duration_s,
        "ttft_ms": distribution_ms([t.ttft for t in done if t.ttft is not None]),
        "tpot_ms": distribution_ms([t.tpot for t in done if t.tpot is not None]),
        "itl_ms": distribution_ms([gap for t in done for gap in t.inter_token_latencies]),
        "e2e_ms": distribution_ms([t.e2e for t in done]),
        # How long a submission waited for its answer: the api's share of TTFT under a burst.
        "accept_ms": distribution_ms([t.accepted - t.sent for t in done if t.accepted is not None]),
        "streamed_events": events,
        "tokens_per_event": output_tokens / events if events else None,
    }
