"""The RQ job function's public path, `worker.jobs.generate` (redis_schema.JOB_FUNCTION):
jobs already in Redis and plain `rq worker` processes name it. It lives in worker.rq.jobs."""

from worker.rq.jobs import generate

__all__ = ["generate"]
