"""Rank 0's side of tensor parallelism: it starts ranks 1..N-1 (`python -m
worker.tp.follower`, one process each), joins them in one torch.distributed group, and
sends them each block move and forward before running its own (`Ranks.run`).

A rank that dies takes the engine down, never hangs it: its pipe and its collective
sockets close, so rank 0's next write or collective raises; from then on every call
raises `TensorParallelError` at once (the group is gone). A failure on rank 0 itself is
the group's too: the others are left inside the step's collectives, so the group is torn
down, which ends them. Ranks 1..N-1 leave when their stdin closes: rank 0 shut them down,
or its process is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import time
import weakref
from typing import Callable, NoReturn, TypeVar

import msgspec
import torch

from pagedq.config import EngineArgs
from worker.tp.group import join_group, leave_group, open_store
from worker.tp.messages import Command, RankStart, write_frame

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long a rank may take to start and join the group (its imports; loading the model
# comes after, inside the group's collective timeout).
_JOIN_TIMEOUT_S = 120.0
# How long a rank whose sockets closed is given to be seen as exited, to name it.
_EXIT_GRACE_S = 2.0


class TensorParallelError(RuntimeError):
    """The ranks can no longer run steps together (one died, or a step failed on one of
    them): the engine is dead and its requests must run elsewhere."""


class Ranks:
    def __init__(self, args: EngineArgs, hf_config, max_model_len: int, device_type: str):
        size = args.tensor_parallel_size
        if device_type == "cpu":
            # The ranks share the host's cores: each takes its part of the threads, as
            # threads contending for a core stall every collective.
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        self._store = open_store(size, is_leader=True)
        self._processes = [
            subprocess.Popen([sys.executable, "-m", "worker.tp.follower"], stdin=subprocess.PIPE)
            for _ in range(1, size)
        ]
        self._finalizer = weakref.finalize(self, _stop, self._processes)
        self._encoder = msgspec.msgpack.Encoder()
        self._broken: str | None = None
        try:
            for rank, process in enumerate(self._processes, start=1):
                start = RankStart(rank, size, self._store.port, dataclasses.asdict(args), hf_config.to_dict(),
                                  max_model_len, torch.get_num_threads())
                write_frame(process.stdin, self._encoder.encode(start))
            self._wait_for_ranks(size)
            self.tp = join_group(self._store, 0, size, device_type)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallelism: %d ranks (pids %s)", size, [p.pid for p in self._processes])

    def _wait_for_ranks(self, size: int) -> None:
        """Every rank has said it is joining (a key in the store), or one died first."""
        keys = [f"joining/{rank}" for rank in range(1, size)]
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        while not self._store.check(keys):
            dead = self._dead()
            if dead:
                raise TensorParallelError(f"tensor-parallel {dead} before joining the group")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel ranks did not join within {_JOIN_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def run(self, command: Command, step: Callable[[], T]) -> T:
        """Send `command` to ranks 1..N-1, then run `step` (the same command) here."""
        self.check_alive()
        try:
            payload = self._encoder.encode(command)
            for process in self._processes:
                write_frame(process.stdin, payload)
            return step()
        except Exception as exc:
            self._break(self._why(exc), exc)

    def check_alive(self) -> None:
        """Raises TensorParallelError once any rank has died, also between steps (an idle
        engine's caller asks, so a dead rank is not found only by the next request)."""
        if self._broken is not None:
            raise TensorParallelError(self._broken)
        dead = self._dead()
        if dead:
            self._break(f"tensor-parallel {dead}", None)

    def _break(self, why: str, cause: Exception | None) -> NoReturn:
        self._broken = why
        logger.error("the engine's tensor-parallel group is broken: %s", why)
        self.shutdown()
        raise TensorParallelError(why) from cause

    def _why(self, exc: Exception) -> str:
        deadline = time.monotonic() + _EXIT_GRACE_S
        while not (dead := self._dead()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return f"tensor-parallel {dead}" if dead else f"a step failed on tensor-parallel rank 0: {exc!r}"

    def _dead(self) -> str:
        exits = [(rank, p.poll()) for rank, p in enumerate(self._processes, start=1)]
        return ", ".join(f"rank {rank} died (exit code {code})" for rank, code in exits if code is not None)

    def shutdown(self) -> None:
        self._finalizer()


def _stop(processes: list[subprocess.Popen]) -> None:
    """Let the other ranks go: an idle one sees its stdin end; one left inside a
    collective (rank 0 failed mid-step) sees the group's sockets close."""
    for process in processes:
        try:
            process.stdin.close()
        except OSError:
            pass  # its pipe broke with it
    leave_group()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
