"""Real processes for the service tests: a redis-server per module (pagedq.redis_server,
AOF on), the api served by real uvicorn in a thread, and `pagedq worker` subprocesses
that tests may SIGKILL or SIGTERM. Nothing is mocked."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import uvicorn

from api.app import create_app
from rq.suspension import suspend

# Imported by the tests from here.
from pagedq.local_service import short_heartbeat_settings as service_settings  # noqa: F401
from pagedq.reference import offline_greedy, offline_outputs  # noqa: F401
from pagedq.redis_schema import stream_key
from pagedq.settings import Settings

REPO = Path(__file__).resolve().parent.parent


def processes_below(marker: str, parent: int | None = None) -> list[psutil.Process]:
    """The processes below this one (or below `parent`) whose command line holds `marker`. One
    that ends or is a zombie while it is read (a short-lived helper: ldconfig, say) is left out."""
    found = []
    for process in psutil.Process(parent).children(recursive=True):
        try:
            if marker in " ".join(process.cmdline()):
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


def count_stream_reads(connection) -> list[int]:
    """From now on, each XREAD sent on `connection` appends how many jobs' streams it names
    (what a stream hub's read costs Redis)."""
    counts: list[int] = []
    xread = connection.xread

    def counting_xread(streams, *args, **kwargs):
        counts.append(sum(key.startswith(stream_key("")) for key in streams))
        return xread(streams, *args, **kwargs)

    connection.xread = counting_xread
    return counts


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


class ApiServer:
    """The real app under real uvicorn, in a thread of the test process."""

    def __init__(self, settings: Settings):
        self.settings = settings
        # log_config=None: uvicorn's records propagate, so tests can read them (API keys must not be there).
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=settings.port, log_config=None)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def start(self) -> ApiServer:
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "uvicorn to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class WorkerProcess:
    """`pagedq worker` as a child process, configured through the PAGEDQ_* environment."""

    def __init__(self, settings: Settings, log_path: Path):
        self.log_path = log_path
        env = {**os.environ, **settings.to_env()}
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pagedq.cli", "worker"], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


def ready_workers(api_url: str, headers: dict[str, str] | None = None) -> list[dict]:
    response = httpx.get(f"{api_url}/ready", headers=headers, timeout=10)
    return response.json()["workers"] if response.status_code == 200 else []


def wait_for_worker(
    api_url: str, name_not_in: set[str] = frozenset(), timeout_s: float = 90, headers: dict[str, str] | None = None
) -> dict:
    """A live worker (per GET /ready) whose name is not in `name_not_in`."""
    return wait_until(
        lambda: next((w for w in ready_workers(api_url, headers) if w["name"] not in name_not_in), None),
        timeout_s, "a worker to register",
    )


def suspend_workers(redis, api_url: str) -> None:
    """`rq suspend`, then wait until the worker says it has stopped taking jobs."""
    suspend(redis)
    wait_until(lambda: {w["state"] for w in ready_workers(api_url)} == {"suspended"}, 10, "the worker to suspend")
