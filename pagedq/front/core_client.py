"""How the front reaches the engine core: one interface, two places the core can run.

`InprocCoreClient`: the core lives in this process and each `get_outputs()` runs one of
its steps; nothing is copied or encoded.

`ProcessCoreClient`: the core runs in a process of its own (pagedq.core.process), as
vLLM V1's EngineCore does: requests go to it and step outputs come back over ZeroMQ
sockets as msgpack (msgspec); the core steps whenever it has work, so the front's output
processing (detokenization, stop strings, outputs) runs beside the core's steps instead
of between them, and never shares a GIL with it. A core process that dies raises
`EngineDeadError` in the front, never a hang.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator, Protocol

from pagedq.config import EngineArgs
from pagedq.core.messages import Abort, AddRequest, CoreInfo, CoreOutputs, SetEosTokenIds, Shutdown, StopSequences

# How long one wait for the core process lasts before its liveness is checked again.
_POLL_MS = 200
# How long the core process may take to load the model and size its cache.
_STARTUP_TIMEOUT_S = 600.0


class EngineDeadError(RuntimeError):
    """The engine core's process is gone, or one of its tensor-parallel ranks; its requests
    are lost to this front."""


class CoreClient(Protocol):
    info: CoreInfo

    def add_request(self, request: AddRequest) -> None: ...

    def abort_requests(self, request_ids: list[int]) -> None: ...

    def stop_sequences(self, sequences: list[tuple[int, int]]) -> None: ...

    def set_eos_token_ids(self, token_ids: set[int]) -> None: ...

    def get_outputs(self, wait: bool) -> list[CoreOutputs]:
        """Outputs of steps run since the last call; with `wait`, at least one step's
        (the core has work whenever the front has unfinished requests)."""

    def stats(self) -> dict: ...

    def check_alive(self) -> None:
        """Raises EngineDeadError if the engine is gone (its process, or one of its ranks)."""

    def shutdown(self) -> None: ...


class InprocCoreClient:
    def __init__(self, args: EngineArgs, load_front: Callable[[], set[int]]):
        from pagedq.core.engine_core import EngineCore

        self.core = EngineCore(args, load_front())
        self.info = self.core.info()

    def add_request(self, request: AddRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[int]) -> None:
        self.core.abort_requests(request_ids)

    def stop_sequences(self, sequences: list[tuple[int, int]]) -> None:
        self.core.stop_sequences(sequences)

    def set_eos_token_ids(self, token_ids: set[int]) -> None:
        self.core.set_eos_token_ids(token_ids)

    def get_outputs(self, wait: bool) -> list[CoreOutputs]:
        if not self.core.has_work():
            return []
        with _ranks_lost_is_death():
            return [self.core.step()]

    def check_alive(self) -> None:
        with _ranks_lost_is_death():
            self.core.check_alive()

    def stats(self) -> dict:
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.shutdown()


class ProcessCoreClient:
    def __init__(self, args: EngineArgs, load_front: Callable[[], set[int]]):
        """Starts the core process, runs `load_front()` (the front's own loading: its config
        and tokenizer; it returns the eos token ids) while that process imports its modules
        and loads the model, then gives the core the ids and waits until it is ready. One
        after the other, `pagedq worker` on 2 cores was listening 12.0-17.2 s after it
        started; side by side, 9.5-12.8 s (5 pairs, bench/results/2026-11-29-worker-start.md)."""
        import torch
        import zmq

        from pagedq.core import messages

        self._encoder = messages.encoder()
        self._decoder = messages.outputs_decoder()
        self._context = zmq.Context()
        self._socket_dir = tempfile.mkdtemp(prefix="pagedq-core-")
        inputs_address = f"ipc://{os.path.join(self._socket_dir, 'in')}"
        outputs_address = f"ipc://{os.path.join(self._socket_dir, 'out')}"
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.bind(inputs_address)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(outputs_address)
        settings = {
            "engine_args": dataclasses.asdict(args), "inputs_address": inputs_address,
            "outputs_address": outputs_address, "parent_pid": os.getpid(), "torch_threads": torch.get_num_threads(),
        }
        self._process = subprocess.Popen([sys.executable, "-m", "pagedq.core.process"], stdin=subprocess.PIPE)
        # The finalizer holds every socket: one collected with the client in the same garbage
        # cycle, before the finalizer runs, is out of the context's sight but still open, and
        # the context's term() would wait for it forever.
        self._finalizer = weakref.finalize(self, _stop, self._process, self._inputs, self._outputs, self._context,
                                           self._socket_dir, self._encoder.encode(Shutdown()))
        # Two lines (pagedq.core.process): the settings now, the eos ids once the front has them.
        self._process.stdin.write(json.dumps(settings).encode() + b"\n")
        self._process.stdin.flush()
        try:
            eos_token_ids = load_front()
        except BaseException:
            self.shutdown()
            raise
        try:
            self._process.stdin.write(json.dumps(sorted(eos_token_ids)).encode() + b"\n")
            self._process.stdin.close()
        except BrokenPipeError:  # the core could not start: it has said why, read next
            pass
        self.info, self._stats = self._wait_until_ready()
        self._received: list[CoreOutputs] = []  # sent by the core, not yet taken by get_outputs

    def _wait_until_ready(self) -> tuple[CoreInfo, dict]:
        import msgspec

        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not self._outputs.poll(_POLL_MS):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.shutdown()
                raise EngineDeadError(
                    f"the engine core process did not start (exit code {self._process.returncode})"
                )
        ready = msgspec.json.decode(self._outputs.recv())
        if "error" in ready:
            self.shutdown()
            error_type, message = ready["error"]
            # A bad model path or setting is the caller's ValueError, as it is in process.
            raise (ValueError if error_type == "ValueError" else RuntimeError)(message)
        return msgspec.convert(ready["info"], CoreInfo), ready["stats"]

    def _send(self, message) -> None:
        """Queued for the core. Once its process is gone the message is dropped: a PUSH
        socket without its peer would block forever, and the core's requests died with
        it (get_outputs raises EngineDeadError)."""
        import zmq

        frame = self._encoder.encode(message)
        while True:
            try:
                self._inputs.send(frame, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if self._process.poll() is not None:
                    return
                self._inputs.poll(_POLL_MS, zmq.POLLOUT)

    def add_request(self, request: AddRequest) -> None:
        self._send(request)

    def abort_requests(self, request_ids: list[int]) -> None:
        if request_ids:
            self._send(Abort(request_ids))

    def stop_sequences(self, sequences: list[tuple[int, int]]) -> None:
        if sequences:
            self._send(StopSequences(sequences))

    def set_eos_token_ids(self, token_ids: set[int]) -> None:
        self._send(SetEosTokenIds(sorted(token_ids)))

    def get_outputs(self, wait: bool) -> list[CoreOutputs]:
        while True:
            self._receive_sent()
            if self._received or not wait:
                received, self._received = self._received, []
                for outputs in received:
                    if outputs.error is not None:
                        raise RuntimeError(f"the engine core's step failed: {outputs.error}")
                return received
            if not self._outputs.poll(_POLL_MS) and self._process.poll() is not None:
                raise EngineDeadError(f"the engine core process died (exit code {self._process.returncode})")

    def _receive_sent(self) -> None:
        """Takes in whatever the core has sent, keeping it for get_outputs and its stats now."""
        import zmq

        while True:
            try:
                frame = self._outputs.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            outputs = self._decoder.decode(frame.buffer)
            if outputs.stats is not None:
                self._stats = outputs.stats
            self._received.append(outputs)

    def check_alive(self) -> None:
        if self._process.poll() is not None:
            raise EngineDeadError(f"the engine core process died (exit code {self._process.returncode})")

    def stats(self) -> dict:
        # The core reports its stats with each message, also after an abort when no step
        # follows (the blocks it freed): read what it sent, or a caller that stops stepping
        # once its requests end (the worker) would show their blocks as taken forever.
        self._receive_sent()
        return dict(self._stats)

    def shutdown(self) -> None:
        self._finalizer()


@contextmanager
def _ranks_lost_is_death() -> Iterator[None]:
    """A tensor-parallel rank lost is the in-process engine's death (in a core process of
    its own, the process ends on it)."""
    from worker.tp.leader import TensorParallelError

    try:
        yield
    except TensorParallelError as exc:
        raise EngineDeadError(str(exc)) from exc


def _stop(process: subprocess.Popen, inputs, outputs, context, socket_dir: str, shutdown_message: bytes) -> None:
    import zmq

    try:
        inputs.send(shutdown_message, flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        pass
    try:
        process.stdin.close()  # a core still waiting for its eos ids: the front gave up on it
    except OSError:
        pass
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)
    for socket in (inputs, outputs):
        socket.close(linger=0)
    context.term()
    shutil.rmtree(socket_dir, ignore_errors=True)


def make_core_client(args: EngineArgs, load_front: Callable[[], set[int]]) -> CoreClient:
    """The engine core, built beside the front's own loading: `load_front()` loads what
    the front needs and returns the eos token ids the core is built with."""
    if args.core_process:
        return ProcessCoreClient(args, load_front)
    return InprocCoreClient(args, load_front)
