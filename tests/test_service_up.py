"""`pagedq up`'s lifecycle with real processes and signals (on the tiny model): Ctrl-C drains
the workers before Redis stops; its children fail in one line, never a traceback; a port or
Redis data directory already in use is reported before anything claims to be up; a fixed
metrics port gives each worker its own; the api runs as many processes as asked, by default
one per four cores."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from redis import Redis
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from pagedq.redis_server import RedisServer, free_port
from pagedq.settings import Settings
from tests.service_helpers import wait_until

pytestmark = pytest.mark.slow
PAGEDQ = str(Path(sys.executable).with_name("pagedq"))


def free_port_pair() -> int:
    """A port whose next one is free too."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


class Up:
    """`pagedq up` in its own process group, as a terminal runs a foreground command (so a
    group-wide SIGINT is what Ctrl-C sends); its output is collected by a thread."""

    def __init__(self, home: Path, *args: str, **env: str):
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("PAGEDQ_")}
        self.env.update(HOME=str(home), PAGEDQ_TORCH_THREADS="1", **env)
        self.process = subprocess.Popen(
            [PAGEDQ, "up", *args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_up(self, timeout_s: float = 120) -> None:
        wait_until(lambda: "pagedq is up:" in self.output or self.process.poll() is not None, timeout_s, "pagedq up")
        assert self.process.poll() is None, self.output

    def field(self, name: str) -> str:
        return re.search(rf"^  {name}: (\S+)", self.output, re.M).group(1)

    def finish(self, timeout_s: float = 60) -> int:
        try:
            code = self.process.wait(timeout_s)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.reader.join(10)
        return code


@pytest.fixture
def model(tiny_model_dir) -> str:
    # Room for jobs long enough to be seen running, however fast the engine.
    return str(tiny_model_dir(max_position_embeddings=4096))


def test_ctrl_c_drains_the_workers_before_redis_stops(model, tmp_path):
    port, metrics_port = free_port(), free_port_pair()
    up = Up(tmp_path, "--model", model, "--port", str(port), "--workers", "2", "--api-workers", "2",
            PAGEDQ_METRICS_PORT=str(metrics_port), PAGEDQ_DRAIN_TIMEOUT_S="0")
    try:
        up.wait_up()
        assert "/ready" not in up.output  # `pagedq up` waits without polling the api (no log lines of its own)
        wait_until(lambda: up.output.count("Application startup complete") == 2, 60, "both api processes to start")
        # A fixed metrics port: each worker its own, the first at the given port.
        assert up.field("worker metrics") == f"http://127.0.0.1:{metrics_port}/metrics,"
        workers = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10).json()["workers"]
        assert sorted(w["metrics_port"] for w in workers) == [metrics_port, metrics_port + 1]
        for p in (metrics_port, metrics_port + 1):
            assert "pagedq:num_requests_running" in httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=10).text
        # Jobs longer than the drain (none): the workers must requeue them, which needs Redis.
        body = {"prompt": "Count to a thousand", "max_tokens": 4000, "ignore_eos": True}
        seq_ids = [httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=10).json()["seq_id"]
                   for _ in range(64)]

        def running() -> list[str]:
            return [s for s in seq_ids
                    if httpx.get(f"http://127.0.0.1:{port}/result/{s}", timeout=10).json()["status"] == "running"]

        were_running = wait_until(running, 60, "jobs to run", interval_s=0)
    finally:
        os.killpg(up.process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert up.finish() == 0, up.output
    assert "Traceback" not in up.output
    # Redis again on the same data (AOF): every job is back in the queue, none left "started".
    server = RedisServer(tmp_path / ".cache" / "pagedq" / "redis").start()
    try:
        redis = Redis.from_url(server.url)
        statuses = dict(zip(seq_ids, (job.get_status() for job in Job.fetch_many(seq_ids, redis, serializer=JSONSerializer))))
        assert set(statuses.values()) <= {"queued", "finished"}, statuses
        assert "queued" in {statuses[s] for s in were_running}, "no running job was requeued"
        assert StartedJobRegistry("pagedq", connection=redis).count == 0
    finally:
        server.stop()


@pytest.mark.parametrize("cores, api_workers", [(1, 1), (2, 1), (7, 1), (8, 2), (12, 3), (16, 4), (128, 4)])
def test_api_processes_default_to_one_per_four_cores(monkeypatch, cores, api_workers):
    """A small machine's cores are the worker's, its engine core's and Redis's too: one api
    process; a GPU host's 16 cores take bursts of submissions on four event loops."""
    monkeypatch.delenv("PAGEDQ_API_WORKERS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert Settings().api_workers == api_workers
    monkeypatch.setenv("PAGEDQ_API_WORKERS", "3")
    assert Settings().api_workers == 3


def test_a_bad_model_is_one_line_and_starts_nothing(tmp_path):
    up = Up(tmp_path, "--model", str(tmp_path / "nothing-here"), "--port", str(free_port()))
    assert up.finish() == 1
    assert up.lines == [f"pagedq: error: model: '{tmp_path / 'nothing-here'}' is not a local Hugging Face "
                        "checkpoint directory (no config.json); pagedq loads weights only from disk\n"]
    assert not (tmp_path / ".cache" / "pagedq" / "redis").exists()


def test_children_fail_in_one_line_each(tmp_path):
    """A checkpoint directory the api and the worker both refuse: each says why in a line."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "architectures": ["NoSuchForCausalLM"]}')
    up = Up(tmp_path, "--model", str(broken), "--port", str(free_port()))
    assert up.finish(120) == 1
    errors = [line for line in up.lines if line.startswith("pagedq: error:")]
    assert errors and errors[-1].startswith("pagedq: error: `pagedq "), up.output
    assert "Traceback" not in up.output and "pagedq is up" not in up.output


def test_a_second_up_is_refused_before_it_claims_anything_then_redis_dying_stops_the_first(model, tmp_path):
    port = free_port()
    first = Up(tmp_path, "--model", model, "--port", str(port))
    try:
        first.wait_up()
        redis_url = first.field("redis")
        assert re.fullmatch(r"redis://127\.0\.0\.1:\d+/0", redis_url)
        assert f"rq info --url {redis_url}" in first.output

        same_port = Up(tmp_path / "elsewhere", "--model", model, "--port", str(port))
        assert same_port.finish() == 1
        assert f"127.0.0.1:{port} is not free" in same_port.output and "pagedq is up" not in same_port.output
        same_cache = Up(tmp_path, "--model", model, "--port", str(free_port()))
        assert same_cache.finish() == 1
        assert "another redis-server started by pagedq uses" in same_cache.output
        assert "pagedq is up" not in same_cache.output
        for refused in (same_port, same_cache):
            assert len(refused.lines) == 1 and "Traceback" not in refused.output

        # Its Redis killed under it: `up` says so in a line and stops its children.
        os.kill(Redis.from_url(redis_url).info("server")["process_id"], signal.SIGKILL)
        assert first.finish(60) == 1
    finally:
        if first.process.poll() is None:
            os.killpg(first.process.pid, signal.SIGINT)
            first.finish()
    assert "pagedq: error: redis-server exited" in first.output
    assert "Traceback" not in first.output
