"""200 documents (log-uniform 1k-100k tokens) summarized through the CLI, the worker
SIGKILLed and the api restarted once 40 are done; then every document's jobs counted: none
lost, none run twice, no chunk finished before the kill redone.

    .venv/bin/python bench/summarize_under_faults.py MODEL_DIR   # e.g. `pagedq make-tiny-model DIR`

(bench/results/2026-11-26-summaries.md has a run's output.)"""
import json, random, signal, sys, time, tempfile, subprocess
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer
sys.path.insert(0, str(REPO))
from pagedq.redis_server import RedisServer
from pagedq.model_info import load_tokenizer
from pagedq.bench.summarize import synthetic_document
from pagedq.client import Client
from tests.service_helpers import ApiServer, WorkerProcess, service_settings, wait_for_worker, wait_until

model = sys.argv[1]
tmp = Path(tempfile.mkdtemp(prefix="i25-200-"))
tok = load_tokenizer(model)
docs = tmp / "docs"; docs.mkdir()
rng = random.Random(200)
lengths = [int(1000 * 100 ** rng.random()) for _ in range(200)]  # log-uniform 1k..100k tokens
for i, n in enumerate(lengths):
    (docs / f"doc-{i:03d}.txt").write_text(synthetic_document(tok, n, seed=i))
print("documents:", len(lengths), "tokens min/median/max", min(lengths), sorted(lengths)[100], max(lengths), "total", sum(lengths), flush=True)
redis_server = RedisServer(tmp / "redis").start()
settings = service_settings(model, redis_server.url, tmp, queue_name="s200", max_model_len=512, batch_poll_interval_s=0.5,
                            torch_threads=1)
worker = WorkerProcess(settings, tmp / "worker-0.log")
api = ApiServer(settings).start()
wait_for_worker(api.url)
t0 = time.monotonic()
out = subprocess.run([sys.executable, "-m", "pagedq.cli", "batch", "submit", "--summarize", str(docs), "--max-tokens", "24",
                      "--temperature", "0", "--url", api.url], capture_output=True, text=True, cwd=REPO)
batch_id = out.stdout.strip()
print("submit exit", out.returncode, batch_id, out.stderr.strip().splitlines()[-1], f"{time.monotonic()-t0:.1f}s", flush=True)
redis = Redis.from_url(redis_server.url)
def jobs_of(i):
    keys = [k.decode() for k in redis.scan_iter(match=f"rq:job:{batch_id}-{i}-*", count=1000) if k.decode().count(":") == 2]
    return Job.fetch_many([k.removeprefix("rq:job:") for k in keys], redis, serializer=JSONSerializer)
with Client(api.url) as client:
    wait_until(lambda: client.batch_get(batch_id)["request_counts"]["completed"] >= 40, 900, "40 documents", interval_s=1)
    at_kill = client.batch_get(batch_id)["request_counts"]
worker.process.send_signal(signal.SIGKILL); worker.process.wait()
api.stop()
all_ids = [k.decode().removeprefix("rq:job:") for k in redis.scan_iter(match=f"rq:job:{batch_id}-*", count=5000) if k.decode().count(":") == 2]
snapshot = Job.fetch_many(all_ids, redis, serializer=JSONSerializer)
finished = {j.id: j.ended_at for j in snapshot if j.get_status(refresh=False) == "finished"}
running = [j.id for j in snapshot if j.get_status(refresh=False) == "started"]
print(f"SIGKILL worker + api restart at {time.monotonic()-t0:.1f}s: {at_kill}, {len(all_ids)} jobs made, {len(finished)} finished, {len(running)} running", flush=True)
worker = WorkerProcess(settings, tmp / "worker-1.log")
api = ApiServer(settings).start()
st = subprocess.run([sys.executable, "-m", "pagedq.cli", "batch", "status", batch_id, "--url", api.url], capture_output=True, text=True, cwd=REPO)
print("status exit", st.returncode, st.stdout.strip(), f"{time.monotonic()-t0:.1f}s", flush=True)
res = subprocess.run([sys.executable, "-m", "pagedq.cli", "batch", "results", batch_id, "-o", str(tmp / "out.jsonl"), "--url", api.url],
                     capture_output=True, text=True, cwd=REPO)
print("results exit", res.returncode, res.stderr.strip().splitlines()[-1], flush=True)
records = [json.loads(l) for l in (tmp / "out.jsonl").read_text().splitlines()]
jobs_total = twice = mismatched = 0
for i, r in enumerate(sorted(records, key=lambda r: r["id"])):
    js = jobs_of(i)
    jobs_total += len(js)
    twice += sum(len(j.results()) != 1 for j in js)
    mismatched += len(js) != sum(s["requests"] for s in r["stages"])
again = {j.id: j.ended_at for j in Job.fetch_many(list(finished), redis, serializer=JSONSerializer)}
stages = [len(r["stages"]) for r in records]
print(f"{len(records)} summaries; {jobs_total} jobs; documents whose job count != their stages' requests: {mismatched}; "
      f"jobs with != 1 result: {twice}; jobs finished before the kill whose end changed: {sum(again[k] != v for k, v in finished.items())}; "
      f"stages per document: min {min(stages)}, max {max(stages)}", flush=True)
api.stop(); worker.stop(); redis_server.stop()
