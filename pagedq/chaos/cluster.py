"""The service under test: its own Redis (AOF on), two `pagedq api` processes on two ports
and two `pagedq worker` processes, each of which the fault injector may kill, stop or
restart in place. Every process writes its own log in the run's directory."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from redis import Redis

from pagedq.local_service import StartupFailed, short_heartbeat_settings, spawn
from pagedq.redis_server import RedisServer, free_port
from pagedq.settings import Settings

API_PROCESSES = 2
WORKER_PROCESSES = 2
# How long a (re)started process may take to serve: a worker imports torch and loads the
# model while the rest of the service and the load share the same cores.
READY_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 20.0


def chaos_settings(model: Path | str, redis_url: str, workdir: Path) -> Settings:
    """The service's settings: the tests' short heartbeats (a lost worker's jobs come back
    within seconds), small engines, and room for batch lines beside the interactive load."""
    return short_heartbeat_settings(
        model, redis_url, workdir, max_num_seqs=16,
        # Of a worker's 16 slots, batch lines may take 12: with the default 16 reserved
        # they would run one at a time and a soak's batches would barely move.
        reserved_interactive_slots=4, batch_poll_interval_s=1.0,
    )


def wait_for(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.25) -> bool:
    """Poll until `predicate()` is true; False when `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def log_tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Child:
    """One api or worker slot: restarted in place with the same settings (an api on its port)."""

    role: str
    index: int
    settings: Settings
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def url(self) -> str:
        return self.settings.base_url

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = spawn(self.role, self.settings, log)

    def exit_status(self) -> int | None:
        return self.process.poll()

    def send(self, signum: int) -> None:
        self.process.send_signal(signum)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        """SIGTERM (a stopped process is woken to receive it); SIGKILL if it will not go."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
        try:
            self.process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self) -> str:
        return log_tail(self.log_path)


class ChaosCluster:
    def __init__(self, model: Path | str, workdir: Path):
        self.workdir = workdir
        self.redis_server = RedisServer(workdir / "redis")
        self.model = model
        self.apis: list[Child] = []
        self.workers: list[Child] = []

    @property
    def children(self) -> list[Child]:
        return self.apis + self.workers

    @property
    def api_urls(self) -> list[str]:
        return [api.url for api in self.apis]

    @property
    def settings(self) -> Settings:
        return self.workers[0].settings

    def start(self) -> ChaosCluster:
        """Redis, then every api and worker; returns once each api answers and every worker is registered."""
        try:
            self.redis_server.start()
            settings = chaos_settings(self.model, self.redis_server.url, self.workdir)
            self.apis = [Child("api", i, settings.with_overrides(port=free_port()), self.workdir / f"api-{i}.log")
                         for i in range(API_PROCESSES)]
            self.workers = [Child("worker", i, settings, self.workdir / f"worker-{i}.log") for i in range(WORKER_PROCESSES)]
            for child in self.children:
                child.start()
            for api in self.apis:
                self.wait_until_serving(api)
            if not wait_for(lambda: len(self.live_worker_names()) >= WORKER_PROCESSES, READY_TIMEOUT_S):
                raise StartupFailed(f"the workers did not register within {READY_TIMEOUT_S:.0f}s; see {self.workdir}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # Workers first (they requeue what they cannot finish), then the apis, then Redis.
        for child in reversed(self.children):
            if child.process is not None:
                child.stop()
        self.redis_server.stop()

    def redis(self) -> Redis:
        return Redis.from_url(self.redis_server.url, socket_timeout=10, socket_connect_timeout=5)

    # ---- readiness ------------------------------------------------------------------

    def wait_until_serving(self, api: Child) -> None:
        def healthy() -> bool:
            if api.exit_status() is not None:
                raise StartupFailed(f"{api.name} exited with status {api.exit_status()}:\n{api.log_tail()}")
            try:
                return httpx.get(f"{api.url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        if not wait_for(healthy, READY_TIMEOUT_S):
            raise StartupFailed(f"{api.name} did not answer /health within {READY_TIMEOUT_S:.0f}s")

    def live_worker_names(self) -> set[str]:
        """The workers GET /ready lists (any api that answers); a worker killed a moment ago
        stays listed until its registration's TTL runs out."""
        for url in self.api_urls:
            try:
                response = httpx.get(f"{url}/ready", timeout=5)
            except httpx.TransportError:
                continue
            if response.status_code == 200:
                return {worker["name"] for worker in response.json()["workers"]}
        return set()

    # ---- restarts -------------------------------------------------------------------

    def restart_api(self, api: Child) -> None:
        api.kill()
        api.start()
        self.wait_until_serving(api)

    def restart_worker(self, worker: Child) -> None:
        """Start it again and wait until it registers (a name /ready had not listed)."""
        known = self.live_worker_names()
        worker.kill()
        worker.start()
        if not wait_for(lambda: self.live_worker_names() - known or worker.exit_status() is not None, READY_TIMEOUT_S):
            raise StartupFailed(f"{worker.name} did not register within {READY_TIMEOUT_S:.0f}s")
        if worker.exit_status() is not None:
            raise StartupFailed(f"{worker.name} exited with status {worker.exit_status()} on restart:\n{worker.log_tail()}")

    def restart_redis(self) -> None:
        """SIGKILL (no AOF flush), then the same port and data directory: what the AOF holds comes back."""
        process = self.redis_server.process
        if process.poll() is None:
            process.kill()
        process.wait()
        self.redis_server.stop()  # the process is gone: this releases the data directory's lock
        self.redis_server.start(timeout_s=60)

    def redis_exit_status(self) -> int | None:
        return self.redis_server.process.poll()

    def redis_log_tail(self) -> str:
        return log_tail(self.redis_server.data_dir / "redis.log")
