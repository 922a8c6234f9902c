"""Which workers of a queue are alive, read from RQ's worker registry: one rule for the
api's GET /ready and for `pagedq up`, which waits for its workers without polling /ready
(so its own polls never appear in the api's access log)."""

from __future__ import annotations

import json

from redis import Redis
from rq import Queue
from rq.worker_registration import get_keys as registered_worker_keys


def live_workers(connection: Redis, queue: Queue) -> list[dict]:
    """The queue's live workers: name, state, engine stats, metrics port, the address Redis
    sees the worker at (where its metrics port listens), and the ranks its engine runs on
    (tensor_parallel_size; absent from workers that predate it: 1)."""
    keys = sorted(registered_worker_keys(queue=queue))
    with connection.pipeline(transaction=False) as pipeline:
        for key in keys:
            pipeline.hmget(key, "state", "death", "engine_stats", "metrics_port", "ip_address", "tensor_parallel_size")
        rows = pipeline.execute()
    workers = []
    for key, (state, death, engine_stats, metrics_port, address, ranks) in zip(keys, rows):
        if state is None or death is not None:
            continue  # expired (no heartbeat) or shut down
        workers.append({
            "name": key.split(":", 2)[-1],
            "state": state.decode(),
            "engine": json.loads(engine_stats) if engine_stats else None,
            "metrics_port": int(metrics_port) if metrics_port else None,
            # RQ's ip_address: "host:port" of the worker's Redis connection.
            "host": address.decode().rpartition(":")[0] if address and b":" in address else None,
            "tensor_parallel_size": int(ranks) if ranks else 1,
        })
    return workers
