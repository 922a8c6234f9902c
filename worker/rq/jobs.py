"""The RQ job function, `worker.jobs.generate` (published there, redis_schema.JOB_FUNCTION).

The batch worker (worker/rq/batch_worker.py) never calls it: it reads the same payload and
runs many jobs through one engine. This function is the fallback that lets a plain
`rq worker` run the service's jobs one at a time with the same result schema:

    PAGEDQ_MODEL=/path/to/ckpt rq worker pagedq pagedq.batch --serializer rq.serializers.JSONSerializer \
        --worker-class rq.worker.SimpleWorker

(SimpleWorker keeps the engine cached between jobs; the forking Worker rebuilds it each job.)
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from rq import get_current_job

from pagedq.protocol import GenerationResult, JobPayload
from pagedq.redis_schema import InvalidJob, request_failure
from pagedq.settings import Settings
from worker.rq.engine_factory import build_engine
from worker.rq.publisher import ProgressPublisher

if TYPE_CHECKING:
    from pagedq.front.llm_engine import LLMEngine


@lru_cache(maxsize=1)
def _process_engine() -> LLMEngine:
    return build_engine(Settings())


def generate(**payload: Any) -> dict:
    job = get_current_job()
    if job is None:
        raise RuntimeError("worker.jobs.generate runs inside an RQ worker")
    try:
        request = JobPayload.read(payload)
    except InvalidJob:
        job.retries_left = 0  # the same on every attempt: retries are for lost workers
        raise
    settings = Settings()
    engine = _process_engine()
    publisher = ProgressPublisher(job.connection, settings.stream_ttl_s, settings.progress_interval_s, settings.stream_interval_s)
    started_at = time.time()

    with job.connection.pipeline() as pipeline:
        publisher.start(pipeline, job, prompt_tokens=len(request.prompt_token_ids), stream=request.stream)
        pipeline.execute()
    try:
        request.add_to(engine, job.id, publisher.report_every_s(request.stream))
    except InvalidJob:
        job.retries_left = 0
        raise
    final = None
    try:
        while final is None:
            for output in engine.step():
                if output.request_id != job.id:
                    continue  # the abort of an earlier job that raised (below)
                publisher.update(job.id, output)
                if output.finished:
                    final = output
            publisher.flush()
    except BaseException:
        # A timeout or Redis error: leave the cached engine free for the next job (or a retry of this one).
        engine.abort_request(job.id)
        raise
    finally:
        publisher.forget(job.id)

    if final.error is not None:
        job.retries_left = 0  # its own fault, alone: it would fail again
        raise request_failure(final.error, final.invalid_input)
    # No "end" event here: RQ records the result only after this returns, and the
    # stream relay ends by itself once it sees the job's terminal status.
    return GenerationResult.from_output(final, job.id, request, started_at).model_dump(mode="json")
