"""`pagedq bench chaos` for ninety seconds, a fault every 12 s (every kind at least once):
no job lost, duplicated or stuck, no 5xx but 503/504, every result the offline engine's.
Run as the CLI runs it, in a process of its own, about two minutes in all on 2 cores.
The checks themselves are shown to fail on records that break each invariant."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from redis import Redis

from pagedq.chaos.checks import JobRecord, check_idempotency, check_jobs, check_texts, keys_without_ttl
from pagedq.chaos.faults import FAULT_KINDS, Fault, FaultInjector
from pagedq.chaos.ledger import Ledger
from pagedq.chaos.load import LoadWindow
from pagedq.redis_server import RedisServer
from tests.service_helpers import REPO


@pytest.mark.slow
def test_a_ninety_second_soak_under_faults_finds_no_violation(tiny_model_dir, tmp_path):
    # Seven faults on a fast machine; every kind at least once on any (the load goes on past
    # its ninety seconds until each kind has had its turn); the long soaks are `pagedq bench chaos`'s
    # (bench/results/2026-11-26-chaos-30min.md), this one keeps the suite inside its budget.
    report_path = tmp_path / "report.json"
    command = [sys.executable, "-m", "pagedq.cli", "bench", "chaos", "--model", str(tiny_model_dir()), "--minutes", "1.5",
               "--fault-every", "12", "--seed", "1", "--workdir", str(tmp_path), "--json", str(report_path)]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=420)
    assert report_path.exists(), finished.stdout[-3000:] + finished.stderr[-3000:]
    report = json.loads(report_path.read_text())

    assert set(report["faults"]["counts"]) == set(FAULT_KINDS)
    assert report["jobs"]["accepted"] > 100 and report["jobs"]["checked_against_offline"] > 100
    assert report["violations"] == [], finished.stdout[-6000:]
    assert finished.returncode == 0


def test_the_load_goes_on_until_every_kind_of_fault_has_been_injected():
    """A soak whose minutes end before a full round of faults (slow recoveries, a slow
    machine) is extended: every kind is injected once, each while the load still runs, and
    no fault comes after the round."""
    window = LoadWindow(time.monotonic() + 0.1, grace_s=0.0)
    planned_until = window.load_until
    injected_while_loading: list[bool] = []

    class SlowRecoveries(FaultInjector):
        def restart_exited(self) -> bool:
            return False

        def inject(self, kind: str) -> None:
            self.faults.append(Fault(kind, "", 0.0, ""))
            injected_while_loading.append(time.monotonic() < window.load_until)
            time.sleep(0.2)

    injector = SlowRecoveries(cluster=None, ledger=Ledger(), every_s=0.05, seed=1)
    stop = threading.Event()
    watcher = threading.Thread(target=injector.run, args=(window, stop), daemon=True)
    watcher.start()
    deadline = time.monotonic() + 30
    while injector.kinds_left() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # past the extended window: nothing more is injected
    stop.set()
    watcher.join(5)

    assert injector.counts() == {kind: 1 for kind in FAULT_KINDS}
    assert injected_while_loading == [True] * len(FAULT_KINDS)
    assert window.load_until > planned_until + 1.0


def job(seq_id: str, state: str, results: int, text: str = "", stream_ends: int = 1, error: str | None = None) -> JobRecord:
    result = {"text": text, "token_ids": []} if state == "finished" else None
    return JobRecord(seq_id, state, results, result, error, payload={}, stream_ends=stream_ends)


def test_the_checks_find_lost_stuck_twice_ended_failed_and_uncanceled_jobs():
    ledger = Ledger()
    for seq_id in ("lost", "stuck", "twice", "uncanceled", "fine", "abandoned", "broken"):
        ledger.accepted(seq_id, "generate-poll")
    ledger.cancel_confirmed("uncanceled")
    jobs = {record.seq_id: record for record in [
        job("stuck", "queued", 0), job("twice", "finished", 2), job("uncanceled", "finished", 1), job("fine", "finished", 1),
        job("abandoned", "failed", 1, error="Moved to FailedJobRegistry, due to AbandonedJobError"),  # retries used up
        job("broken", "failed", 1, error="RuntimeError: boom"),
        job("orphan", "running", 0, stream_ends=2),
    ]}
    found = [(violation.kind, violation.detail.split(" ")[0]) for violation in check_jobs(ledger, jobs)]
    assert sorted(found) == [("cancel-not-kept", "uncanceled:"), ("ended-twice", "orphan"), ("ended-twice", "twice"),
                             ("failed", "broken"), ("lost", "lost"), ("stuck", "orphan"), ("stuck", "stuck")]


def test_the_checks_find_two_jobs_for_one_key_and_a_text_that_is_not_the_result():
    ledger = Ledger()
    ledger.accepted("a", "submit-twice", idempotency_key="k")
    ledger.accepted("b", "submit-twice", idempotency_key="k")
    ledger.received_text("a", "stream", "hello")
    ledger.received_text("b", "stream", "hello")
    jobs = {"a": job("a", "finished", 1, text="hello"), "b": job("b", "finished", 1, text="hell")}
    assert [v.kind for v in check_idempotency(ledger)] == ["idempotency"]
    assert [v.detail.split(" ")[0] for v in check_texts(ledger, jobs)] == ["b"]


def test_keys_without_a_ttl_are_counted_by_pattern_rq_structures_left_out(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        redis = Redis.from_url(server.url)
        redis.hset("rq:job:idem-0123456789abcdef0123", "status", "canceled")
        redis.hset("rq:job:4f2a9c1e8b7d6a5f4e3d2c1b0a998877", "status", "canceled")
        redis.set("pagedq:stream:4f2a9c1e8b7d6a5f4e3d2c1b0a998877", "x", ex=60)  # expires: not reported
        redis.incr("pagedq:cancels:pagedq")
        redis.rpush("rq:queue:pagedq", "some-job")  # RQ's structure: lives as long as the queue
        assert keys_without_ttl(redis) == ({"rq:job:{id}": 2}, {"pagedq:cancels:pagedq": 1})
    finally:
        server.stop()
