"""How the batch worker marks the jobs it took started (worker/rq/job_starts.py): RQ's
bookkeeping, as RQ's readers see it, and a cancel or a delete that lands between the
worker's read of a job and its write wins over the start."""

from __future__ import annotations

import pytest
from rq.job import Job, JobStatus
from rq.worker import Worker

from api.auth import ANYONE
from api.jobs import ENQUEUE_SCRIPT, JobStore
from pagedq.protocol import GenerateRequest
from pagedq.redis_schema import EXECUTION_FIELD, JOB_SERIALIZER, InvalidJob
from pagedq.settings import Settings
from worker.rq.job_starts import start_jobs

pytestmark = pytest.mark.slow


@pytest.fixture
def store(redis):
    redis.flushdb()
    return JobStore(redis, Settings(redis_url="redis://unused"), on_enqueued=lambda queue, count: None)


def take(store: JobStore, count: int) -> list[str]:
    """Queue `count` jobs as the api does, then move them to the intermediate list as the worker's sync script does."""
    seq_ids = []
    for _ in range(count):
        job = store.prepare(GenerateRequest(prompt="hi", max_tokens=4), [5, 6, 7], None, owner=ANYONE.tenant)
        assert store.connection.eval(ENQUEUE_SCRIPT, len(job.keys), *job.keys, *job.args) == 1
        seq_ids.append(job.seq_id)
    for _ in seq_ids:
        store.connection.lmove(store.queue.key, store.queue.intermediate_queue_key, "LEFT", "RIGHT")
    return seq_ids


def start(store: JobStore, ids: list[str], between=lambda: None):
    """start_jobs as the worker calls it; `between` runs after the jobs were read and before the write is sent."""
    worker = Worker([store.queue, store.batch_queue], connection=store.connection, serializer=JOB_SERIALIZER)
    worker.register_birth()

    def mark_busy(pipeline):
        between()
        worker.set_state("busy", pipeline)

    return worker, start_jobs(store.connection, ids, worker.queues, JOB_SERIALIZER, worker.name, 60, 600, mark_busy)


def test_started_jobs_are_what_rq_shows_and_leave_the_intermediate_list(store):
    ids = take(store, 3)
    worker, started = start(store, ids)
    assert [item.job.id for item in started] == ids
    for item in started:
        job = Job.fetch(item.job.id, connection=store.connection, serializer=JOB_SERIALIZER)
        assert job.get_status() == JobStatus.STARTED
        assert job.worker_name == worker.name
        assert store.connection.hget(job.key, EXECUTION_FIELD).decode() == item.execution.composite_key
        assert (job.id, item.execution.id) in store.queue.started_job_registry.get_job_and_execution_ids()
        assert item.payload.prompt_token_ids == [5, 6, 7] and item.error is None
    assert store.connection.llen(store.queue.intermediate_queue_key) == 0
    assert store.connection.hget(worker.key, "state") == b"busy"


def test_a_queued_job_without_a_created_at_is_started_all_the_same(store):
    """RQ's jobs always carry one; a job another writer made without it is run, not dropped
    from the intermediate list unstarted (lost)."""
    ids = take(store, 2)
    store.connection.hdel(Job.key_for(ids[0]), "created_at")
    _, started = start(store, ids)
    assert [item.job.id for item in started] == ids
    assert store.connection.hget(Job.key_for(ids[0]), "status") == JobStatus.STARTED.value.encode()


def test_a_job_canceled_or_deleted_before_the_read_is_left_out(store):
    ids = take(store, 3)
    store.connection.hset(Job.key_for(ids[0]), "status", JobStatus.CANCELED.value)
    store.connection.delete(Job.key_for(ids[1]))
    _, started = start(store, ids)
    assert [item.job.id for item in started] == ids[2:]
    assert store.connection.hget(Job.key_for(ids[0]), "status") == JobStatus.CANCELED.value.encode()
    assert store.connection.llen(store.queue.intermediate_queue_key) == 0


def test_a_cancel_or_a_reenqueue_between_the_read_and_the_write_wins(store):
    """The job read as queued is canceled, or deleted and enqueued again under its id (an
    Idempotency-Key reused after it expired), after the worker read it: neither is started
    nor overwritten, and the worker does not run the payload it read."""
    ids = take(store, 3)
    canceled, replaced, kept = ids
    connection = store.connection

    def between():
        connection.hset(Job.key_for(canceled), "status", JobStatus.CANCELED.value)
        raw = connection.hgetall(Job.key_for(replaced))
        connection.delete(Job.key_for(replaced))
        raw[b"created_at"] = b"2030-01-01T00:00:00.000000Z"
        connection.hset(Job.key_for(replaced), mapping=raw)

    _, started = start(store, ids, between)
    assert [item.job.id for item in started] == [kept]
    for seq_id in (canceled, replaced):
        assert connection.hget(Job.key_for(seq_id), EXECUTION_FIELD) is None
        assert connection.hget(Job.key_for(seq_id), "worker_name") in (None, b"")
        assert seq_id not in store.queue.started_job_registry.get_job_ids()
    assert connection.hget(Job.key_for(canceled), "status") == JobStatus.CANCELED.value.encode()
    assert connection.hget(Job.key_for(replaced), "status") == JobStatus.QUEUED.value.encode()
    assert connection.llen(store.queue.intermediate_queue_key) == 0


def test_a_job_that_is_not_ours_to_run_comes_back_with_its_error(store):
    ids = take(store, 2)
    store.connection.hset(Job.key_for(ids[0]), "data", Job.create("os.system", args=["x"], serializer=JOB_SERIALIZER,
                                                                    connection=store.connection).to_dict()["data"])
    _, started = start(store, ids)
    assert [item.job.id for item in started] == ids
    assert started[0].error is not None and started[0].error[0] is InvalidJob
    assert started[1].error is None
