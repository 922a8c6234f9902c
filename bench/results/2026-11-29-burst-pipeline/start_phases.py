"""What starting a job costs the worker, by phase (uncontended): 512 jobs enqueued as the api
enqueues them, then `start_jobs` 32 at a time, each phase timed with perf_counter.
Needs a redis-server of its own: `redis-server --port 6399 --save ''` (REDIS_PORT to change);
it flushes that server. Run from the repository root: `.venv/bin/python bench/results/2026-11-29-burst-pipeline/start_phases.py`."""
import collections
import os
import random
import sys
import time

sys.path.insert(0, os.getcwd())
from redis import Redis
from rq.executions import Execution
from rq.job import Job
from rq.worker import Worker

import worker.rq.job_starts as job_starts
from api.auth import ANYONE
from api.jobs import ENQUEUE_SCRIPT, JobStore
from pagedq.protocol import GenerateRequest
from pagedq.redis_schema import JOB_SERIALIZER
from pagedq.settings import Settings

spent = collections.Counter()


def timed(owner, name, label, classmethod_=False):
    original = getattr(owner, name).__func__ if classmethod_ else getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start
    setattr(owner, name, classmethod(wrapper) if classmethod_ else wrapper)


for owner, name, label, is_class in [
    (Job, "restore", "Job.restore", False), (Job, "prepare_for_execution", "Job.prepare_for_execution", False),
    (Job, "__init__", "Job.__init__", False), (Execution, "create", "Execution.create", True),
    (job_starts.JobPayload, "read", "JobPayload.read", True), (job_starts, "record_execution", "record_execution", False),
    (job_starts, "start_progress", "start_progress", False), (job_starts, "queue_job_starts", "queue_job_starts", False),
]:
    timed(owner, name, label, is_class)

redis = Redis(port=int(os.environ.get("REDIS_PORT", 6399)))
redis.flushdb()
store = JobStore(redis, Settings(redis_url="redis://unused"), on_enqueued=lambda queue, count: None)
ids = []
for _ in range(512):
    prompt = [random.randrange(1000) for _ in range(random.randrange(32, 256))]
    body = GenerateRequest(prompt_token_ids=prompt, max_tokens=128, ignore_eos=True, stream=False)
    job = store.prepare(body, prompt, None, owner=ANYONE.tenant)
    assert redis.eval(ENQUEUE_SCRIPT, len(job.keys), *job.keys, *job.args) == 1
    ids.append(job.seq_id)
for _ in ids:
    redis.lmove(store.queue.key, store.queue.intermediate_queue_key, "LEFT", "RIGHT")
worker = Worker([store.queue, store.batch_queue], connection=redis, serializer=JOB_SERIALIZER)
worker.register_birth()
spent.clear()
cpu = time.thread_time()
for at in range(0, len(ids), 32):
    job_starts.start_jobs(redis, ids[at:at + 32], worker.queues, JOB_SERIALIZER, worker.name, 60, 600,
                          lambda pipeline: worker.set_state("busy", pipeline))
print(f"start_jobs: {1e6 * (time.thread_time() - cpu) / len(ids):.0f} us of CPU a job")
for label, seconds in spent.most_common():
    print(f"  {label:26} {1e6 * seconds / len(ids):6.1f} us a job")
