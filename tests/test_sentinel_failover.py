"""Redis Sentinel: a real primary, replica and sentinel on loopback (`redis-server
--sentinel`); the api and a worker reach Redis only through
`PAGEDQ_REDIS_URL=redis+sentinel://...`. The primary is SIGKILLed with jobs in flight:
the sentinel promotes the replica, api and worker follow it, and every job finishes
exactly once (one result, never restarted) with the offline engine's tokens."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from pagedq.client import Client, ClientError
from pagedq.redis_schema import PROGRESS_META_KEY
from pagedq.redis_connection import SentinelTarget, connect
from pagedq.redis_server import RedisServer, find_redis_server, free_port
from tests.service_helpers import ApiServer, WorkerProcess, offline_greedy, service_settings, wait_for_worker, wait_until

pytestmark = pytest.mark.slow
SERVICE = "pagedq-test"


class SentinelProcess:
    """`redis-server sentinel.conf --sentinel` watching one primary, failing over after 3 s of silence (less, and a loaded test machine sees spurious failovers)."""

    def __init__(self, data_dir: Path, primary_port: int):
        data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        config = data_dir / "sentinel.conf"  # the sentinel rewrites it: a file of its own
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {data_dir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 3000\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
        )
        with open(data_dir / "sentinel.log", "ab") as log:
            self.process = subprocess.Popen([find_redis_server(), str(config), "--sentinel"], stdout=log, stderr=subprocess.STDOUT)
        self.client = Redis(port=self.port, socket_timeout=2)

    def primary_port(self) -> int:
        return int(self.client.sentinel_get_master_addr_by_name(SERVICE)[1])

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)


def test_sentinel_url_parsing():
    target = SentinelTarget.parse("redis+sentinel://:secret@10.0.0.1:26380,sentinel-b/my-service/3?sentinel_password=s2")
    assert target.sentinels == [("10.0.0.1", 26380), ("sentinel-b", 26379)]
    assert (target.service, target.db, target.password, target.sentinel_password) == ("my-service", 3, "secret", "s2")
    for bad in ("redis+sentinel://h:1", "redis+sentinel://h:x/s", "redis+sentinel://h:1/s/db"):
        with pytest.raises(ValueError, match="redis_url"):
            SentinelTarget.parse(bad)


@pytest.fixture
def sentinel_cluster(tmp_path):
    primary = RedisServer(tmp_path / "primary").start()
    replica = RedisServer(tmp_path / "replica", extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start()
    sentinel = SentinelProcess(tmp_path / "sentinel", primary.port)
    try:
        # The replica in sync, and known to the sentinel (from the primary's INFO), before anything runs:
        # what it has not received when the primary dies is lost (Redis replicates asynchronously).
        wait_until(lambda: _in_sync(replica), 30, "the replica's first sync", interval_s=0.1)
        wait_until(lambda: _known_replicas(sentinel), 30, "the sentinel to discover the replica", interval_s=0.2)
        yield primary, replica, sentinel
    finally:
        sentinel.stop()
        replica.stop()
        primary.stop()


def _in_sync(replica: RedisServer) -> bool:
    info = Redis(port=replica.port).info("replication")
    return info.get("master_link_status") == "up" and not info.get("master_sync_in_progress")


def _known_replicas(sentinel: SentinelProcess) -> list:
    try:
        return [r for r in sentinel.client.sentinel_slaves(SERVICE) if "s_down" not in r.get("flags", "")]
    except Exception:
        return []


def requests(count: int) -> list[dict]:
    return [
        {"prompt_token_ids": [5 + (i * 17 + j) % 300 for j in range(3 + i % 4)], "max_tokens": 400,
         "ignore_eos": True, "temperature": 0}
        for i in range(count)
    ]


def test_failover_loses_and_repeats_nothing(sentinel_cluster, tiny_model_dir, tmp_path):
    primary, replica, sentinel = sentinel_cluster
    model = tiny_model_dir()
    url = f"redis+sentinel://127.0.0.1:{sentinel.port}/{SERVICE}"
    settings = service_settings(model, url, tmp_path, heartbeat_ttl_s=15)
    api = ApiServer(settings).start()
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    bodies = requests(24)
    try:
        wait_for_worker(api.url)
        with Client(api.url, timeout_s=30) as client:
            before = [client.submit(**body)["seq_id"] for body in bodies[:16]]
            redis = connect(url)
            # Jobs in flight: running on the worker (started, in the started registry), every
            # one of them: a start written between the mark below and the kill is lost with the
            # primary (replication is asynchronous) and its job runs again, attempt 2 (3 jobs
            # did in one CI run, started as the primary died).
            in_flight = wait_until(lambda: (started := redis.zcard("rq:wip:pagedq")) == len(before) and started, 30,
                                   "every job to start", interval_s=0.01)
            # Everything written so far has reached the replica (a write, then WAIT for one
            # replica to have it: the replication stream is ordered), as a replica kept in
            # step by a real deployment would have; then the primary dies mid-run.
            to_primary = Redis(port=primary.port)
            to_primary.set("test:replication-mark", 1)
            assert to_primary.wait(1, 5000) == 1
            primary.process.send_signal(signal.SIGKILL)
            primary.process.wait(10)
            wait_until(lambda: sentinel.primary_port() == replica.port, 30, "the sentinel to promote the replica", interval_s=0.2)
            after = [_submit_retrying(client, body) for body in bodies[16:]]
            seq_ids = before + after
            results = [client.wait(seq_id) for seq_id in seq_ids]
        assert in_flight > 0
        assert "Redis is unreachable" in worker.log()  # it did lose its primary mid-run
        assert [r["status"] for r in results] == ["finished"] * len(seq_ids), worker.log()[-3000:]
        assert [r["token_ids"] for r in results] == offline_greedy(model, bodies)
        jobs = Job.fetch_many(seq_ids, connection=redis, serializer=JSONSerializer)
        # One recorded result each, and no job was started a second time (attempt 2 would say so).
        assert [len(job.results()) for job in jobs] == [1] * len(seq_ids)
        assert [job.meta[PROGRESS_META_KEY]["attempt"] for job in jobs] == [1] * len(seq_ids)
    finally:
        api.stop()
        worker.stop()


def _submit_retrying(client: Client, body: dict) -> str:
    """POST /generate, retrying the 503s an api gives while no primary is reachable."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return client.submit(**body)["seq_id"]
        except ClientError as exc:
            if exc.status != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
