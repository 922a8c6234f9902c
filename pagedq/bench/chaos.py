"""`pagedq bench chaos`: a soak under faults that proves no job is lost, duplicated or stuck.

It starts its own service on this machine (Redis with AOF on, two `pagedq api` processes,
two `pagedq worker` processes on the CPU, short heartbeats), runs a steady mixed load
against it (pagedq.chaos.load) while injecting a fault every `--fault-every` seconds
(pagedq.chaos.faults: SIGKILL or SIGSTOP a worker, SIGKILL an api, SIGKILL and restart
Redis, fill Redis' memory), lets the queues drain, and checks the invariants
(pagedq.chaos.checks). The report lists jobs, faults, response statuses, violations
(each with what it takes to debug it) and warnings (keys that never expire, Redis memory);
exit status 1 when any violation was found. The run's directory keeps every process's log
and Redis' AOF: it is removed after a clean run unless `--workdir` was given.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from pagedq.bench.workload import positive_float, positive_int
from pagedq.cli import CommandError

# How long clients may go on following their jobs after the load stops, and how long the
# queues then get to drain, before the checks call what is left stuck.
_CLIENT_GRACE_S = 60.0
_DRAIN_TIMEOUT_S = 60.0
_VIOLATIONS_PRINTED = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint directory (default: a tiny random-weight model built for the run)")
    parser.add_argument("--minutes", type=positive_float, default=5.0, help="how long the load and the faults go on (default 5); longer when the "
                        "recoveries leave a kind of fault not yet injected by then")
    parser.add_argument("--fault-every", type=positive_float, default=20.0, metavar="S",
                        help="seconds between faults (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the load and the order and targets of faults")
    parser.add_argument("--clients", type=positive_int, default=10, help="client threads of the load (default 10)")
    parser.add_argument("--workdir", help="where the run's directory (logs, Redis' AOF) goes; kept "
                        "(default: a temporary directory, kept only when a violation is found)")
    parser.add_argument("--json", metavar="PATH", help="also write the report here")


def run(args: argparse.Namespace) -> int:
    from pagedq.bench.report import write_json

    keep = args.workdir is not None
    if keep:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    # A fresh directory every run: a Redis started on an old AOF would replay the old run's jobs.
    workdir = Path(tempfile.mkdtemp(prefix="pagedq-chaos-", dir=args.workdir))
    report = soak(args, workdir)
    print(render(report), flush=True)
    if args.json:
        write_json(args.json, args, report)
    if report["passed"] and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"chaos: logs and Redis' AOF are in {workdir}")
    return 0 if report["passed"] else 1


def soak(args: argparse.Namespace, workdir: Path) -> dict:
    """Start the service, load it under faults, let it drain, check; the report."""
    from pagedq.chaos.checks import read_end_state, used_memory, wait_for_drain
    from pagedq.chaos.cluster import ChaosCluster
    from pagedq.chaos.faults import FaultInjector
    from pagedq.chaos.ledger import Ledger
    from pagedq.chaos.load import LoadWindow
    from pagedq.local_service import StartupFailed
    from pagedq.tiny_model import make_tiny_model

    model = args.model or str(make_tiny_model(workdir / "tiny-llama", "llama"))
    started = time.monotonic()
    try:
        cluster = ChaosCluster(model, workdir).start()
    except (StartupFailed, RuntimeError) as exc:  # RuntimeError: redis-server would not start
        raise CommandError(f"the service did not start: {exc} (logs in {workdir})") from None
    try:
        print(f"chaos: service up in {time.monotonic() - started:.0f}s (redis {cluster.redis_server.url}, "
              f"apis {' '.join(cluster.api_urls)}); {args.minutes:g} min of load, a fault every {args.fault_every:g}s",
              flush=True)
        redis = cluster.redis()
        memory_before = used_memory(redis)
        ledger = Ledger()
        injector = FaultInjector(cluster, ledger, args.fault_every, args.seed)
        planned_until = time.monotonic() + args.minutes * 60
        window = LoadWindow(planned_until, _CLIENT_GRACE_S)
        with _faults(injector, window):
            clients_left = _run_load(cluster, ledger, args, window)
            unended = wait_for_drain(redis, _DRAIN_TIMEOUT_S)
            print(f"chaos: load stopped; {len(unended)} jobs had not ended after the drain", flush=True)
            end = read_end_state(redis)
    finally:
        cluster.stop()
    checked, violations = _violations(model, ledger, end.jobs)
    # Every end state named, the ones no job reached too.
    states = {"finished": 0, "failed": 0, "canceled": 0, **Counter(job.state for job in end.jobs.values())}
    return {
        "passed": not violations,
        "config": {"started_at": ledger.started_at, "model": model, "minutes": args.minutes,
                   "fault_every_s": args.fault_every, "seed": args.seed, "clients": args.clients, "workdir": str(workdir),
                   "apis": len(cluster.apis), "workers": len(cluster.workers), "clients_still_running_at_the_end": clients_left,
                   # How long the load ran past its minutes for every kind of fault to be injected once.
                   "load_extended_s": round(window.load_until - planned_until, 1)},
        "jobs": {"accepted": len(ledger.jobs), "in_redis": len(end.jobs),
                 "not_seen_by_a_client": len(end.jobs.keys() - ledger.jobs.keys()), **dict(sorted(states.items())),
                 "checked_against_offline": checked,
                 "client_texts_compared": sum(len(job.texts) for job in ledger.jobs.values())},
        "scenarios": dict(sorted(ledger.scenarios.items())),
        "faults": {"counts": injector.counts(), "log": [asdict(fault) for fault in injector.faults]},
        "responses": {"by_status": dict(sorted(ledger.statuses.items())), "by_route": dict(sorted(ledger.routes.items())),
                      "transport_errors": dict(sorted(ledger.transport_errors.items()))},
        "violation_counts": dict(Counter(violation.kind for violation in violations)),
        "violations": [asdict(violation) for violation in violations],
        "warnings": {"keys_that_should_expire_but_never_do": end.keys_never_expiring,
                     "fixed_keys_without_ttl": end.fixed_keys_without_ttl},
        "redis_memory": {"before_bytes": memory_before, "after_bytes": end.used_memory},
    }


@contextmanager
def _faults(injector, window) -> Iterator[None]:
    """Faults while the load runs (FaultInjector.run); after that, until the block ends, the
    injector only restarts what exits (the drain and the reading of Redis need the whole service)."""
    stop = threading.Event()
    watcher = threading.Thread(target=injector.run, args=(window, stop), name="chaos-faults", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


def _run_load(cluster, ledger, args: argparse.Namespace, window) -> int:
    """The load until the window's load_until, its clients' last jobs followed a while
    longer; how many clients were still running when the wait for them ended."""
    from pagedq.chaos.load import LoadGenerator

    load = LoadGenerator(cluster.api_urls, ledger, cluster.settings.model_id, args.seed, args.clients)
    load.start(window)
    # A request under way when the clients give up may still take its own timeout.
    return load.join(window, slack_s=30)


def _violations(model: str, ledger, jobs: dict) -> tuple[int, list]:
    """(how many jobs the offline engine checked, every violation): the clients' and the checks'."""
    from pagedq.chaos.checks import check_against_offline, check_idempotency, check_jobs, check_texts

    checked, mismatches = check_against_offline(model, jobs)
    return checked, [*ledger.violations, *check_jobs(ledger, jobs), *check_idempotency(ledger),
                     *check_texts(ledger, jobs), *mismatches]


def render(report: dict) -> str:
    jobs, faults, memory = report["jobs"], report["faults"], report["redis_memory"]
    lines = [
        "chaos soak: " + ("PASSED" if report["passed"] else f"FAILED, {len(report['violations'])} violations")
        + f" (times below: seconds since {report['config']['started_at']})",
        "jobs: " + ", ".join(f"{name} {count}" for name, count in jobs.items()),
        "scenarios: " + ", ".join(f"{name} {count}" for name, count in report["scenarios"].items()),
        "faults: " + ", ".join(f"{kind} {count}" for kind, count in sorted(faults["counts"].items())),
        *(f"  at {fault['at_s']:>6.1f}s ({fault['clock']}) {fault['kind']:<18} {fault['target']:<9} recovered after "
          f"{fault['recovered_after_s']}s {fault['detail']}".rstrip() for fault in faults["log"]),
        "responses by status: " + ", ".join(f"{status} {count}" for status, count in report["responses"]["by_status"].items()),
        "connection errors: " + (", ".join(f"{kind} {count}" for kind, count in report["responses"]["transport_errors"].items())
                                 or "none"),
        f"redis used_memory: {memory['before_bytes']} bytes before, {memory['after_bytes']} after",
    ]
    if report["violations"]:
        lines.append("violations: " + ", ".join(f"{kind} {count}" for kind, count in report["violation_counts"].items()))
        lines += [_violation_line(violation) for violation in report["violations"][:_VIOLATIONS_PRINTED]]
        if len(report["violations"]) > _VIOLATIONS_PRINTED:
            lines.append(f"  ... and {len(report['violations']) - _VIOLATIONS_PRINTED} more (--json has them all)")
    warnings = report["warnings"]
    lines.append("warning: keys that should expire but never do: "
                 + (", ".join(f"{pattern} x{count}" for pattern, count in warnings["keys_that_should_expire_but_never_do"].items())
                    or "none"))
    lines.append("fixed keys without a TTL: " + (", ".join(warnings["fixed_keys_without_ttl"]) or "none"))
    return "\n".join(lines)


def _violation_line(violation: dict) -> str:
    when = "" if violation["at_s"] is None else f" at {violation['at_s']}s"
    return f"  [{violation['kind']}]{when} {violation['detail']}"
