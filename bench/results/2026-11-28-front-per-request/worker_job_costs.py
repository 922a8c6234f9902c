"""Per-job CPU of the batch worker's RQ start (worker/rq/job_starts.py) and success writes
(worker/rq/outcomes.py), against a Redis of its own: N jobs queued as the api queues them,
moved to the intermediate list as the worker's sync script moves them, started 32 at a time,
then finished 32 at a time. Run it from a checkout (PYTHONPATH=TREE) to compare two:

    PYTHONPATH=/tmp/base .venv/bin/python worker_job_costs.py 512 [-v]
"""
import cProfile, pstats, sys, time, uuid
from redis import Redis
from rq.serializers import JSONSerializer
from rq.worker import Worker
from rq.job import Job
from pagedq.redis_server import RedisServer
from pagedq.settings import Settings
from pagedq.protocol import GenerateRequest, GenerationResult, Usage, Timings
from api.jobs import JobStore, ENQUEUE_SCRIPT
from worker.rq.job_starts import start_jobs
from worker.rq.inflight import InFlight
from worker.rq import outcomes
from pagedq.redis_schema import queue_fenced_commands, batch_queue_name

N = int(sys.argv[1]) if len(sys.argv) > 1 else 512
import tempfile; server = RedisServer(__import__("pathlib").Path(tempfile.mkdtemp())).start()
conn = Redis.from_url(server.url)
settings = Settings(redis_url=server.url)
store = JobStore(conn, settings, on_enqueued=lambda q, c: None)
req = GenerateRequest(prompt="hello", max_tokens=64)
ids = []
with conn.pipeline(transaction=False) as p:
    for i in range(N):
        prep = store.prepare(req, list(range(100)), None, "")
        p.eval(ENQUEUE_SCRIPT, len(prep.keys), *prep.keys, *prep.args)
        ids.append(prep.seq_id)
    p.execute()
# As the sync script does: move to the intermediate list.
q = store.queue
for _ in ids:
    conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
worker = Worker([q, store.batch_queue], connection=conn, serializer=JSONSerializer)
worker.register_birth()
prof = cProfile.Profile()
t0 = time.perf_counter(); c0 = time.process_time()
prof.enable()
started = []
for at in range(0, N, 32):
    started += start_jobs(conn, ids[at:at + 32], worker.queues, JSONSerializer, worker.name, 60, 600, lambda p: None)
prof.disable()
t1 = time.perf_counter(); c1 = time.process_time()
print(f"start: {(t1-t0)/N*1e3:.3f} ms/job wall, {(c1-c0)/N*1e3:.3f} ms/job cpu")
entries = []
for s in started:
    e = InFlight(s.job, q, s.execution, s.payload, started_at=time.time())
    e.result = GenerationResult(seq_id=s.job.id, prompt="hello", text="x" * 300, token_ids=list(range(64)), finish_reason="length",
                                usage=Usage(prompt_tokens=100, completion_tokens=64), timings=Timings(enqueued=1.0, started=2.0, first_token=3.0, finished=4.0))
    entries.append(e)
prof2 = cProfile.Profile()
t0 = time.perf_counter(); c0 = time.process_time()
prof2.enable()
for at in range(0, N, 32):
    writes = [outcomes.success(worker, e, 60, 600) for e in entries[at:at + 32]]
    with conn.pipeline(transaction=False) as p:
        queue_fenced_commands(p, writes)
        lost = p.execute()[0]
        assert not lost, lost
prof2.disable()
t1 = time.perf_counter(); c1 = time.process_time()
print(f"success: {(t1-t0)/N*1e3:.3f} ms/job wall, {(c1-c0)/N*1e3:.3f} ms/job cpu")
assert Job.fetch(ids[0], connection=conn, serializer=JSONSerializer).get_status() == "finished"
if "-v" in sys.argv:
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof2).sort_stats("cumulative").print_stats(35)
server.stop()
