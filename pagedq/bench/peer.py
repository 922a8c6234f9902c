"""What every benchmarked generator ("peer") provides, and how peers are measured.

A peer is set up (model load, cache allocation: not timed), warmed up on a few short
requests (not timed), then runs the whole workload under the clock, once per round. It
returns the token ids each request asked for, so every peer's throughput counts the same
tokens. Rounds alternate the peers' order (forward, then backward, ...) so a drift in the
machine's speed does not favour whoever runs first; each peer reports min / median / max.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
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

    # Optional, for peers that run in other processes: stop them while other peers are
    # timed (pause) and continue them for their own passes (resume).


@dataclass
class PeerRun:
    peer: str
    counting_rule: str
    token_ids: list[list[int]]  # from the first round
    computed_tokens: int
    round_seconds: list[float] = field(default_factory=list)
    # CPU time of this process (all its threads) over each timed pass: for in-process peers,
    # what a pass cost the machine.
    round_cpu_seconds: list[float] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.token_ids)

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def seconds(self) -> float:
        """The median round's."""
        return statistics.median(self.round_seconds)

    def _rate(self, seconds: float) -> float:
        return self.output_tokens / seconds if seconds > 0 else float("inf")

    @property
    def tokens_per_s(self) -> float:
        return self._rate(self.seconds)

    def summary(self) -> dict:
        return {
            "peer": self.peer,
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "computed_tokens": self.computed_tokens,
            "seconds": self.seconds,
            "cpu_seconds": statistics.median(self.round_cpu_seconds) if self.round_cpu_seconds else None,
            "output_tokens_per_s": self.tokens_per_s,
            "output_tokens_per_s_min": self._rate(max(self.round_seconds)),
            "output_tokens_per_s_max": self._rate(min(self.round_seconds)),
            "round_seconds": self.round_seconds,
            "counting_rule": self.counting_rule,
        }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _start(peer: Peer, workload: Workload, device: torch.device) -> None:
    peer.setup(workload)
    peer.generate(workload.head(WARMUP_REQUESTS, WARMUP_OUTPUT_LEN), progress=False)
    _synchronize(device)


def _timed(peer: Peer, workload: Workload, device: torch.device, progress: bool) -> tuple[Generation, float, float]:
    """The pass's generation, wall seconds and this process's CPU seconds."""
    start, cpu_start = time.perf_counter(), time.process_time()
    generation = peer.generate(workload, progress)
    _synchronize(device)
    return generation, time.perf_counter() - start, time.process_time() - cpu_start


def _pause(peer: Peer) -> None:
    if hasattr(peer, "pause"):
        peer.pause()


def _resume(peer: Peer) -> None:
    if hasattr(peer, "resume"):
        peer.resume()


def measure_rounds(peers: list[Peer], workload: Workload, device: torch.device, rounds: int,
                   progress: bool) -> list[PeerRun]:
    """Times every peer `rounds` times, alternating their order. On a CPU every peer stays
    set up across rounds (loads are slow and memory is plentiful); on a GPU each is set up
    and closed around each of its passes, so peers that size their cache from free device
    memory each get the whole device."""
    keep = device.type == "cpu"
    runs: dict[str, PeerRun] = {}
    started: list[Peer] = []
    try:
        if keep:
            for peer in peers:
                started.append(peer)
                _start(peer, workload, device)
                _pause(peer)
        for round_index in range(rounds):
            for peer in peers if round_index % 2 == 0 else peers[::-1]:
                if not keep:
                    started.append(peer)
                    _start(peer, workload, device)
                _resume(peer)
                try:
                    generation, seconds, cpu_seconds = _timed(peer, workload, device, progress)
                finally:
                    _pause(peer)
                    if not keep:
                        started.remove(peer)
                        peer.close()
                run = runs.setdefault(
                    peer.name, PeerRun(peer.name, peer.counting_rule, generation.token_ids, generation.computed_tokens)
                )
                run.round_seconds.append(seconds)
                run.round_cpu_seconds.append(cpu_seconds)
    finally:
        for peer in started:
            peer.close()
    return [runs[peer.name] for peer in peers]


def measure(peer: Peer, workload: Workload, device: torch.device, progress: bool) -> PeerRun:
    """One peer, one timed pass."""
    return measure_rounds([peer], workload, device, rounds=1, progress=progress)[0]
