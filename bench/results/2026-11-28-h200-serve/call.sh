#!/usr/bin/env bash
# Issue 23's two GPU rows at one head, on one lent machine in one call (bench/results/2026-11-28-h200-serve.md):
#   DEADLINE=470 bash bench/results/2026-11-28-h200-serve/call.sh     from the repository root, .whl/ carried
# `pagedq bench serve` (its own Redis, api and worker; every request at once; streaming clients;
# offline `LLM.generate` of the same workload right after the service stops) for bench-56m at
# 32:256 in/out and the llama-3.2-1b shape at 100:1024, bf16, rounds alternated between the
# models; a served warm-up first fills the kernel cache. Then, with the time left, py-spy over
# one 56m served run (every process, on-CPU samples). $OUT: all.log (every run's output),
# serve.jsonl (each run's JSON), pyspy.txt.gz.
# Knobs for a dry run on a CPU: DEVICE, DTYPE, SMALL, LARGE (presets or "" for the tiny
# default), NUM_PROMPTS, LARGE_LENS, WHEELS (a folder of wheels to install; "" for none).
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DEADLINE=${DEADLINE:-470} DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bfloat16} NUM_PROMPTS=${NUM_PROMPTS:-256}
WHEELS=${WHEELS-.whl} SMALL=${SMALL-bench-56m} LARGE=${LARGE-llama-3.2-1b} LARGE_LENS=${LARGE_LENS:-100:1024}
if [ -n "$WHEELS" ]; then
    rm -rf /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
left() { echo $((DEADLINE - SECONDS)); }
cli() { local limit=$1; shift; timeout "$limit" python3 -m pagedq.cli "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null; nproc
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
make() { cli 240 make-tiny-model ${1:+--preset $1} /tmp/models/m-$1 > /dev/null 2>&1; }
make "$SMALL" & small=$!
make "$LARGE" &
serve() {  # LABEL MODEL LENS [ARGS...]
    echo "=== $1 $(date +%T) ${SECONDS}s"
    cli 200 bench serve --model /tmp/models/m-$2 --device $DEVICE --dtype $DTYPE --num-prompts $NUM_PROMPTS \
        --input-len $3 --output-len $3 --stream "${@:4}" --json /tmp/serve.json > /tmp/serve.log 2>&1
    echo "=== $1" >> "$OUT/all.log"; cat /tmp/serve.log >> "$OUT/all.log"
    [ -s /tmp/serve.json ] && python3 -c 'import json, sys
print(json.dumps({"run": sys.argv[1], "result": json.load(open("/tmp/serve.json"))}))' "$1" >> "$OUT/serve.jsonl"
    rm -f /tmp/serve.json
    grep -E "^pagedq|serve / offline|CPU seconds|Error|error" /tmp/serve.log | tail -6
}
wait $small
serve "56m warm-up" "$SMALL" 32:256 --no-offline
wait
serve "1b warm-up" "$LARGE" $LARGE_LENS --no-offline
for r in 1 2 3; do
    [ $(left) -gt 40 ] && serve "56m r$r" "$SMALL" 32:256
    [ $(left) -gt 90 ] && serve "1b r$r" "$LARGE" $LARGE_LENS
done
if [ $(left) -gt 45 ] && [ -x /tmp/site/bin/py-spy ]; then
    echo "=== 56m under py-spy $(date +%T) ${SECONDS}s"
    timeout $(( $(left) - 5 )) /tmp/site/bin/py-spy record --subprocesses --nonblocking --rate 200 --format raw \
        -o "$OUT/pyspy.txt" -- python3 -m pagedq.cli bench serve --model /tmp/models/m-$SMALL --device $DEVICE \
        --dtype $DTYPE --num-prompts $NUM_PROMPTS --input-len 32:256 --output-len 32:256 --stream --no-offline 2>&1 \
        | grep -E "^pagedq|CPU seconds"
    gzip -f "$OUT/pyspy.txt"
fi
echo "=== done ${SECONDS}s"
