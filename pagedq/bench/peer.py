"""What every benchmarked generator ("peer") provides, and how one is measured.

A peer is set up once (model load, cache allocation: not timed), warmed up on a few short
requests (not timed), then runs the whole workload under the clock. It returns the token
ids each request asked for, so every peer's throughput counts the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedq.bench.workload import Workload

# The warm-up runs this many requests for at most this many tokens each.
WARMUP_REQUESTS = 2
WARMUP_OUTPUT_LEN = 4


@dataclass
class Generation:
    # Per request, in workload order: the output tokens that count (at most its output length).
    token_ids: list[list[int]]
    # Tokens the peer decoded, including any it produced past a request's length (static batches).
    computed_tokens: int


class Peer(Protocol):
    name: str
    # One line saying which tokens count as output for this peer.
    counting_rule: str

    def setup(self, workload: Workload) -> None:
        """Loads the model and sizes caches for `workload`, outside the timed region."""

    def generate(self, workload: Workload, progress: bool) -> Generation: ...

    def close(self) -> None: ...


@dataclass
class PeerRun:
    peer: str
    counting_rule: str
    token_ids: list[list[int]]
    computed_tokens: int
    seconds: float
    # CPU time of this process (all its threads) over the timed pass: for in-process peers, what the pass cost the machine.
    cpu_seconds: float | None = None

    @property
    def requests(self) -> int:
        return len(self.token_ids)

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("inf")

    def summary(self) -> dict:
        return {
            "peer": self.peer,
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "computed_tokens": self.computed_tokens,
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "output_tokens_per_s": self.tokens_per_s,
            "counting_rule": self.counting_rule,
        }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(peer: Peer, workload: Workload, device: torch.device, progress: bool) -> PeerRun:
    """Sets the peer up, warms it up, times one pass over the workload, and closes it, so
    peers that size their cache from free device memory each get the whole device."""
    peer.setup(workload)
    try:
        peer.generate(workload.head(WARMUP_REQUESTS, WARMUP_OUTPUT_LEN), progress=False)
        _synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        generation = peer.generate(workload, progress)
        _synchronize(device)
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
    finally:
        peer.close()
    return PeerRun(peer.name, peer.counting_rule, generation.token_ids, generation.computed_tokens, seconds, cpu_seconds)
