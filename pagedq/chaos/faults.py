"""The fault injector: one fault every `every_s` seconds, the kinds taken in turn in a
seeded order, each followed by its recovery (the process restarted and serving again)
before the next. Until every kind has been injected once it keeps the load going past its
planned end (the LoadWindow), so a soak covers every kind however long the recoveries take
on a slow machine (a worker restarted on two loaded cores took 33 s of a 90 s soak). Between
faults it watches the service: a process that exits on its own is a violation (with the end
of its log), and is restarted so the soak goes on."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from redis.exceptions import RedisError

from pagedq.chaos.cluster import ChaosCluster, Child
from pagedq.chaos.ledger import Ledger
from pagedq.chaos.load import LoadWindow
from pagedq.local_service import StartupFailed

FAULT_KINDS = ("kill-worker", "stop-worker", "kill-api", "restart-redis", "fill-redis-memory")
# Redis memory is capped this far above what it uses, so the load's next writes are refused.
_MEMORY_HEADROOM_BYTES = 64 * 1024
_MEMORY_HOLD_S = 5.0
_WATCH_INTERVAL_S = 0.5


@dataclass
class Fault:
    kind: str
    target: str
    # When it was injected: seconds since the soak started, and the wall clock (as the processes' logs show it).
    at_s: float
    clock: str
    # How long until the service was whole again (None: it was not).
    recovered_after_s: float | None = None
    detail: str = ""


class FaultInjector:
    def __init__(self, cluster: ChaosCluster, ledger: Ledger, every_s: float, seed: int):
        self.cluster = cluster
        self.ledger = ledger
        self.every_s = every_s
        self.rng = random.Random(seed)
        self.order = self.rng.sample(FAULT_KINDS, len(FAULT_KINDS))
        self.faults: list[Fault] = []

    def counts(self) -> dict[str, int]:
        return dict(Counter(fault.kind for fault in self.faults))

    def kinds_left(self) -> bool:
        """Whether a kind of fault has not been injected yet."""
        return len(self.counts()) < len(FAULT_KINDS)

    def run(self, window: LoadWindow, stop: threading.Event) -> None:
        """Inject faults while the load runs (until the window's load_until, moved later
        while a kind has not been injected yet), then only watch, until `stop`."""
        next_fault_at = time.monotonic() + self.every_s
        while not stop.is_set():
            if self.restart_exited():
                next_fault_at = max(next_fault_at, time.monotonic() + self.every_s / 2)
            if self.kinds_left():
                # The load goes on through the next fault and a while after it.
                window.load_until = max(window.load_until, max(next_fault_at, time.monotonic()) + self.every_s / 2)
            if time.monotonic() >= next_fault_at and time.monotonic() < window.load_until:
                self.inject(self.order[len(self.faults) % len(self.order)])
                # However long the recovery took, the service runs whole for a while before
                # the next fault: faults one on top of another would test less, not more.
                next_fault_at = max(next_fault_at + self.every_s, time.monotonic() + self.every_s / 2)
            stop.wait(_WATCH_INTERVAL_S)

    def inject(self, kind: str) -> None:
        fault = Fault(kind, target="", at_s=self.ledger.elapsed_s(), clock=time.strftime("%H:%M:%S"))
        self.faults.append(fault)
        started = time.monotonic()
        action: Callable[[Fault], None] = getattr(self, "_" + kind.replace("-", "_"))
        try:
            action(fault)
            fault.recovered_after_s = round(time.monotonic() - started, 1)
        except (StartupFailed, RedisError, OSError) as exc:
            self.ledger.violation("no-recovery", f"after {kind} of {fault.target or 'the service'}: {exc}")
        print(f"chaos: at {fault.at_s:.0f}s ({fault.clock}) {kind} {fault.target} {fault.detail} (recovered after "
              f"{fault.recovered_after_s}s)", flush=True)

    # ---- the faults -----------------------------------------------------------------

    def _kill_worker(self, fault: Fault) -> None:
        worker = self._pick(self.cluster.workers, fault)
        worker.send(signal.SIGKILL)
        self.cluster.restart_worker(worker)

    def _stop_worker(self, fault: Fault) -> None:
        """SIGSTOP past the heartbeat TTL: the other worker reaps its jobs and reruns them;
        woken, it must write nothing for them."""
        worker = self._pick(self.cluster.workers, fault)
        settings = self.cluster.settings
        stalled_s = settings.heartbeat_ttl_s + 2 * settings.reaper_interval_s + 2.0
        fault.detail = f"stopped {stalled_s:.1f}s"
        worker.send(signal.SIGSTOP)
        try:
            time.sleep(stalled_s)
        finally:
            worker.send(signal.SIGCONT)

    def _kill_api(self, fault: Fault) -> None:
        api = self._pick(self.cluster.apis, fault)
        api.send(signal.SIGKILL)
        self.cluster.restart_api(api)

    def _restart_redis(self, fault: Fault) -> None:
        fault.target = "redis"
        self.cluster.restart_redis()

    def _fill_redis_memory(self, fault: Fault) -> None:
        """maxmemory just above what Redis uses, noeviction: writes are refused (OOM) for a while."""
        fault.target = "redis"
        redis = self.cluster.redis()
        try:
            used = redis.info("memory")["used_memory"]
            redis.config_set("maxmemory-policy", "noeviction")
            redis.config_set("maxmemory", used + _MEMORY_HEADROOM_BYTES)
            fault.detail = f"maxmemory {used + _MEMORY_HEADROOM_BYTES} bytes for {_MEMORY_HOLD_S:.0f}s"
            time.sleep(_MEMORY_HOLD_S)
        finally:
            redis.config_set("maxmemory", 0)
            redis.close()

    def _pick(self, children: list[Child], fault: Fault) -> Child:
        child = self.rng.choice(children)
        fault.target = child.name
        return child

    # ---- watching -------------------------------------------------------------------

    def restart_exited(self) -> bool:
        """Restart what exited on its own (no fault of ours is in progress): each is a
        violation. Whether anything had."""
        exited = False
        if self.cluster.redis_exit_status() is not None:
            self._restart_after_exit(f"redis-server exited with status {self.cluster.redis_exit_status()}",
                                     self.cluster.restart_redis, self.cluster.redis_log_tail())
            exited = True
        for child in self.cluster.children:
            status = child.exit_status()
            if status is not None:
                restart = self.cluster.restart_api if child.role == "api" else self.cluster.restart_worker
                self._restart_after_exit(f"{child.name} exited with status {status}", partial(restart, child),
                                         child.log_tail())
                exited = True
        return exited

    def _restart_after_exit(self, what: str, restart: Callable[[], None], log_tail: str) -> None:
        at_s, started = self.ledger.elapsed_s(), time.monotonic()
        try:
            restart()
            outcome = f"serving again after {time.monotonic() - started:.1f}s"
        except (StartupFailed, RedisError, OSError) as exc:
            outcome = f"could not be restarted: {exc}"
        self.ledger.violation("process-exit", f"{what}; {outcome}; its log ends:\n{log_tail}", at_s)
