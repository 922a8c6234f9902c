"""Requeues what dead workers left behind, for any live batch worker to run.

Two kinds of leftovers: jobs in a queue's started registry whose execution stopped
beating (RQ's registry cleanup requeues them, or fails them when out of retries), and ids
a worker moved to a queue's intermediate list (RQ's crash-safe hand-off) but died before
starting. RQ's own maintenance finds the second kind only after minutes; here an id that
sits there for a heartbeat TTL goes back to its queue's front.
"""

from __future__ import annotations

import logging
import time

import redis.exceptions
from redis import Redis
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import as_text


class Reaper:
    def __init__(self, connection: Redis, queues: list[Queue], serializer, heartbeat_ttl_s: float, log: logging.Logger,
                 worker_name: str):
        self.connection = connection
        self.queues = queues
        self.serializer = serializer
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.log = log
        self.worker_name = worker_name
        # (queue name, job id) -> when the id was first seen in the queue's intermediate list.
        self._stranded_since: dict[tuple[str, str], float] = {}

    def reap(self) -> int:
        """One pass over every queue; how many jobs went back to a queue."""
        requeued = 0
        for queue in self.queues:
            registry = queue.started_job_registry
            abandoned = registry.get_expired_job_ids()
            registry.cleanup()
            if abandoned:
                statuses = [job.get_status(refresh=False) if job else None
                            for job in Job.fetch_many(abandoned, self.connection, serializer=self.serializer)]
                requeued += statuses.count(JobStatus.QUEUED)
            requeued += self._requeue_stranded(queue)
        return requeued

    def _requeue_stranded(self, queue: Queue) -> int:
        """Ids that sat in the queue's intermediate list for a heartbeat TTL without being
        started were taken by a worker that died before starting them (a live one starts
        what it takes within its tick): back to the queue's front."""
        now = time.monotonic()
        ids = [as_text(i) for i in self.connection.lrange(queue.intermediate_queue_key, 0, -1)]
        seen = {(queue.name, job_id): self._stranded_since.get((queue.name, job_id), now) for job_id in ids}
        self._stranded_since = {key: since for key, since in self._stranded_since.items() if key[0] != queue.name}
        self._stranded_since.update(seen)
        stale = [job_id for (_, job_id), since in seen.items() if now - since >= self.heartbeat_ttl_s]
        requeued = 0
        for job_id in stale:
            with self.connection.pipeline() as pipeline:
                try:
                    # A stalled worker that starts it meanwhile changes its hash: then it is that worker's.
                    pipeline.watch(Job.key_for(job_id))
                    queued = pipeline.hget(Job.key_for(job_id), "status") == JobStatus.QUEUED.value.encode()
                    pipeline.multi()
                    pipeline.lrem(queue.intermediate_queue_key, 1, job_id)
                    if queued:  # else canceled or deleted: nothing to run
                        pipeline.lpush(queue.key, job_id)
                    pipeline.execute()
                except redis.exceptions.WatchError:
                    continue
            del self._stranded_since[(queue.name, job_id)]
            if queued:
                self.log.warning("Worker %s: requeued %s, stranded by a dead worker in %s", self.worker_name, job_id, queue.name)
                requeued += 1
        return requeued
