"""The engine core in a process of its own (pagedq.front.core_client.ProcessCoreClient).

Started as `python -m pagedq.core.process` (never by re-importing the caller's main
module, as multiprocessing's spawn would), its settings as a line of JSON on stdin, then
the eos token ids as another once the front has loaded its tokenizer: the core imports its
modules and builds itself in between, beside the front's own loading. The first message
it sends is JSON: ready (with the core's CoreInfo and stats) or why it could not start.

The loop: take every message waiting on the input socket (requests, aborts, stops); step
whenever there is work, sending each step's outputs (with the core's stats) back; block
on the input socket when idle. A step that raises drops every request and tells the
front, which raises; a tensor-parallel rank that failed ends the process (the engine is
dead), so the front raises EngineDeadError. The process leaves when told, or when its parent is gone; it
ignores SIGINT and SIGTERM, which are its parent's to act on (a worker draining after
SIGTERM still needs its engine).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys


def run_core_process(settings: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("PAGEDQ_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    # Before any thread starts (torch's, zmq's): Linux keeps a nice value and a scheduling
    # policy per thread, and a new thread takes its creator's.
    front_nice = os.getpriority(os.PRIO_PROCESS, 0)
    _set_nice(settings["engine_args"].get("core_nice"))
    _set_realtime(settings["engine_args"].get("core_realtime_priority"))
    import msgspec
    import torch
    import zmq

    from pagedq.config import EngineArgs
    from pagedq.core import messages
    from pagedq.core.engine_core import EngineCore
    from pagedq.gc_tuning import freeze_startup_heap
    from worker.tp.leader import TensorParallelError

    torch.set_num_threads(settings["torch_threads"])
    parent_pid = settings["parent_pid"]
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.connect(settings["outputs_address"])
    try:
        # Built while the front loads its tokenizer; the eos ids it finds apply before any request.
        core = EngineCore(EngineArgs(**settings["engine_args"]), set())
    except Exception as exc:
        outputs.send(msgspec.json.encode({"error": [type(exc).__name__, str(exc)]}))
        context.destroy(linger=5000)
        return
    eos_line = sys.stdin.readline()
    if not eos_line:  # the front gave up before it had them
        core.shutdown()
        context.destroy(linger=0)
        return
    core.set_eos_token_ids(set(json.loads(eos_line)))
    freeze_startup_heap()
    priority = BatchPriority(front_nice, os.getpriority(os.PRIO_PROCESS, 0), core.scheduler.config.max_num_seqs)
    outputs.send(msgspec.json.encode({"info": msgspec.to_builtins(core.info()), "stats": core.stats()}))
    inputs = context.socket(zmq.PULL)
    inputs.connect(settings["inputs_address"])
    encoder, decoder = messages.encoder(), messages.input_decoder()
    logger = logging.getLogger(__name__)
    try:
        while True:
            # An orphan (its front SIGKILLed) stops at once, busy or idle: nobody reads its
            # tokens, and its cores are wanted by the front's replacement.
            if os.getppid() != parent_pid:
                return
            if not core.has_work():
                while not inputs.poll(1000):
                    if os.getppid() != parent_pid:
                        return
                    core.check_alive()  # a rank that died while idle ends the process too
            changed = False
            while True:
                try:
                    frame = inputs.recv(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                message = decoder.decode(frame.buffer)
                if isinstance(message, messages.Shutdown):
                    return
                changed |= _handle(core, message)
            out = None
            if core.has_work() or changed:
                try:
                    out = core.step()
                except TensorParallelError:
                    raise
                except Exception as exc:
                    logger.exception("an engine step failed; every request was dropped")
                    out = messages.CoreOutputs(error=repr(exc))
                priority.follow(core.scheduler.num_running)
            if out is not None and (out.request_ids or out.unreported_tokens or out.finished or out.token_chunks
                                    or out.failed or out.beams or out.scheduled or out.error is not None) or changed:
                out = out or messages.CoreOutputs()
                out.stats = core.stats()
                outputs.send(encoder.encode(out), copy=False)
    except TensorParallelError as exc:
        # A rank is gone: this process ends, and the front sees the engine die.
        logger.error("the engine's tensor-parallel ranks failed: %s", exc)
        raise SystemExit(1) from exc
    finally:
        core.shutdown()
        context.destroy(linger=0)


class BatchPriority:
    """The core's raised priority (EngineArgs.core_nice below the front's) holds while its batch
    is at least a quarter of max_num_seqs; below that its threads run at the front's priority.

    A raised core takes a CPU from everything else the host runs for as long as it has work,
    and a near-empty batch's steps do little with it. On 2 CPUs a burst of 512 polled
    requests reached the engine one at a time while the core, raised, ran the first of them
    alone for ~100 steps: the api admitting the rest and the worker starting them (RQ's
    bookkeeping, at a tenth of a CPU) waited for it. At the front's priority while the batch
    is small, the burst is admitted sooner and the service made ~100 fewer steps of the same
    work (bench/results/2026-11-29-burst-pipeline.md); once the batch is large its steps
    are the service's critical path again, and streaming needs the core raised (at the front's
    priority throughout, the api used its share to send 30% more, smaller SSE events).
    Its tensor-parallel ranks keep the priority they started with."""

    def __init__(self, front_nice: int, core_nice: int, max_num_seqs: int):
        self.front_nice = front_nice
        self.core_nice = core_nice
        self.busy_from = max(1, max_num_seqs // 4)
        self.current = core_nice
        # Only a raised core (a lower nice value than the front's, which needed the privilege
        # to set) moves; one at the front's value or below its priority stays as it is.
        self.enabled = core_nice < front_nice

    def follow(self, running: int) -> None:
        """After a step: the priority for a batch of `running` requests."""
        if not self.enabled:
            return
        nice = self.core_nice if running >= self.busy_from else self.front_nice
        if nice == self.current:
            return
        self.current = nice
        try:
            _renice_threads(nice)
        except PermissionError:  # the privilege was dropped since it started: stay as it is
            self.enabled = False
            logging.getLogger(__name__).warning("the engine core's priority no longer follows its batch: "
                                                "nice %d was refused", nice)


def _renice_threads(nice: int) -> None:
    """Every thread of this process to `nice` (Linux keeps one per thread)."""
    threads = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for thread in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, int(thread), nice)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def _set_nice(nice: int | None) -> None:
    if nice is None or os.getpriority(os.PRIO_PROCESS, 0) == nice:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        logging.getLogger(__name__).warning(
            "the engine core keeps its parent's priority (nice %d): nice %d needs CAP_SYS_NICE or RLIMIT_NICE",
            os.getpriority(os.PRIO_PROCESS, 0), nice)


def _set_realtime(priority: int | None) -> None:
    if priority is None:
        return
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except PermissionError:
        logging.getLogger(__name__).warning(
            "the engine core keeps normal scheduling: SCHED_FIFO needs CAP_SYS_NICE or RLIMIT_RTPRIO")


def _handle(core, message) -> bool:
    """Apply one message; True when the front should hear of it even if no step runs
    (freed blocks its stats should show, a refused request)."""
    from pagedq.core import messages

    if isinstance(message, messages.AddRequest):
        try:
            core.add_request(message)
        except Exception as exc:  # the front validated it: this request's fault alone, whatever it is
            core.report_failure(message.request_id, f"the engine core refused it: {exc!r}")
            return True
        return False
    if isinstance(message, messages.Abort):
        core.abort_requests(message.request_ids)
        return True
    if isinstance(message, messages.StopSequences):
        core.stop_sequences(message.sequences)
        return True
    if isinstance(message, messages.SetEosTokenIds):
        core.set_eos_token_ids(set(message.token_ids))
    return False


if __name__ == "__main__":
    run_core_process(json.loads(sys.stdin.readline()))
