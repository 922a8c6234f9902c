"""Nothing in Redis lives forever unless asked: canceled jobs expire like finished ones
(RQ's cancel sets no TTL), and the api's sweep prunes what outlives expired records (RQ's
canceled registries, the indexes of files and batches)."""

from __future__ import annotations

import time

import pytest
from rq.registry import CanceledJobRegistry

from api.auth import ANYONE
from api.jobs import ENQUEUE_SCRIPT, AlreadyFinished, JobStore
from api.retention import sweep
from pagedq.protocol import GenerateRequest
from pagedq.redis_schema import BATCHES_KEY, FILES_KEY, batch_queue_name, tenant_batches_key
from pagedq.settings import Settings

pytestmark = pytest.mark.slow


def submit(store: JobStore, count: int) -> list[str]:
    """Queue `count` jobs as the api does (JobStore.enqueue sends ENQUEUE_SCRIPT in the shared round trip; here, one call each)."""
    request = GenerateRequest(prompt="hi", max_tokens=4)
    seq_ids = []
    for _ in range(count):
        job = store.prepare(request, [5, 6], None, owner=ANYONE.tenant)
        assert store.settle(job, store.connection.eval(ENQUEUE_SCRIPT, len(job.keys), *job.keys, *job.args)) == "queued"
        seq_ids.append(job.seq_id)
    return seq_ids


def test_canceled_queued_jobs_expire_one_by_one_and_in_bulk(redis, tiny_model_dir):
    settings = Settings(model=str(tiny_model_dir("llama")), queue_name="retention", result_ttl_s=600)
    store = JobStore(redis, settings)
    alone, *bulk = submit(store, 4)
    store.cancel(alone, ANYONE)
    store.cancel_many(bulk)
    for seq_id in [alone, *bulk]:
        assert store.snapshot(seq_id, ANYONE).status == "canceled"
        assert 0 < redis.ttl(f"rq:job:{seq_id}") <= 600
    assert store.queue.count == 0


def test_the_sweep_prunes_entries_older_than_their_records(redis, tiny_model_dir):
    settings = Settings(model=str(tiny_model_dir("llama")), queue_name="sweep", result_ttl_s=100, files_ttl_s=1000)
    now = time.time()
    canceled = CanceledJobRegistry(batch_queue_name("sweep"), connection=redis).key
    redis.zadd(canceled, {"old-job": now - 101, "new-job": now - 99})
    for key in (FILES_KEY, BATCHES_KEY, tenant_batches_key("some-tenant")):
        redis.zadd(key, {"old": now - 1001, "new": now - 999})
    assert sweep(redis, settings) == 4
    assert redis.zrange(canceled, 0, -1) == [b"new-job"]
    for key in (FILES_KEY, BATCHES_KEY, tenant_batches_key("some-tenant")):
        assert redis.zrange(key, 0, -1) == [b"new"]


def test_a_cancel_is_one_step_with_the_jobs_end(redis, tiny_model_dir):
    """The chaos soak's race: a cancel that read "running" while the worker recorded the
    result then canceled a finished job (two ends, a result kept). Now the check and the
    cancel are one script: a finished job stays finished, with no second end."""
    from pagedq.redis_schema import stream_key

    settings = Settings(model=str(tiny_model_dir("llama")), queue_name="cancel-race")
    store = JobStore(redis, settings)
    finished, queued = submit(store, 2)
    redis.hset(f"rq:job:{finished}", "status", "finished")  # the worker's success write won
    with pytest.raises(AlreadyFinished):
        store.cancel(finished, ANYONE)
    assert redis.hget(f"rq:job:{finished}", "status") == b"finished" and redis.xlen(stream_key(finished)) == 0
    store.cancel(queued, ANYONE)
    store.cancel(queued, ANYONE)  # again: nothing more happens
    assert [fields[b"status"] for _, fields in redis.xrange(stream_key(queued))] == [b"canceled"]
