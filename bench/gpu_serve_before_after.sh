#!/usr/bin/env bash
# Issue 23's GPU rows, before and after, on one lent GPU machine in one call:
#   bash bench/gpu_serve_before_after.sh BEFORE_TREE
# BEFORE_TREE: the earlier commit's files (e.g. `git archive COMMIT | tar -x -C .base`, carried
# with .whl/). For each model, a served run first fills Triton's kernel cache with every variant
# a served batch needs (an offline warm-up does not: on 2026-11-26 the side measured first paid
# 0.3-0.4 s more engine-core CPU and ~0.4 s more TTFT), then `pagedq bench serve` (its own Redis,
# api and worker; streaming clients; offline beside it) runs before, then after, then after with
# one api process (after's default is one per four cores: four on a 16-core host). With the time
# left before DEADLINE_S (the call's limit less a margin), the GPU tests of the engine run, then
# a second pair in the other order. $OUT gets three files (a device call brings back eight at
# most): every run's full log in all.log, the runs' JSON one per line in serve.jsonl, tests.log.
# Knobs for a dry run on a CPU: DEVICE, DTYPE, SPECS ("preset in:out;..."), NUM_PROMPTS.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bfloat16} NUM_PROMPTS=${NUM_PROMPTS:-256}
SPECS=${SPECS:-"bench-56m 32:256;llama-3.2-1b 100:1024"}
DEADLINE_S=${DEADLINE_S:-570}
before=$(cd "$1" && pwd)
after=$PWD
if [ -d .whl ]; then
    rm -rf /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null; nproc
left() { echo $((DEADLINE_S - SECONDS)); }
run() {  # TREE SECONDS ARGS...: the CLI of that tree, for at most SECONDS
    local tree=$1 limit=$2; shift 2
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "$limit" python3 -m pagedq.cli "$@")
}
serve() {  # MODEL_NAME LENS SIDE ROUND [ARGS...]: one streamed bench serve with offline beside it
    local tree=$after; [ $3 = before ] && tree=$before
    echo "=== $1 serve --stream, $3 (round $4) ${*:5} $(date +%T), ${SECONDS}s"
    run "$tree" 200 bench serve --model /tmp/models/$1 --device $DEVICE --dtype $DTYPE \
        --num-prompts $NUM_PROMPTS --input-len $2 --output-len $2 --stream "${@:5}" \
        --json /tmp/serve.json > /tmp/serve.log 2>&1
    cat /tmp/serve.log >> "$OUT/all.log"
    [ -s /tmp/serve.json ] && python3 -c 'import json, sys
print(json.dumps({"run": sys.argv[1], "result": json.load(open("/tmp/serve.json"))}))' "$1 $3 $4" >> "$OUT/serve.jsonl"
    rm -f /tmp/serve.json
    grep -v 'it/s]\|pkg_resources\|^\s*$' /tmp/serve.log | tail -9
}
IFS=';' read -ra specs <<< "$SPECS"
for spec in "${specs[@]}"; do
    set -- $spec
    [ -d /tmp/models/$1 ] || run "$after" 300 make-tiny-model --preset $1 /tmp/models/$1 >/dev/null
    echo "=== $1: warm-up (served, fills the kernel cache) $(date +%T), ${SECONDS}s"
    run "$after" 200 bench serve --model /tmp/models/$1 --device $DEVICE --dtype $DTYPE \
        --num-prompts $NUM_PROMPTS --input-len $2 --output-len $2 --no-offline > /tmp/warmup.log 2>&1
    cat /tmp/warmup.log >> "$OUT/all.log"
    grep '^pagedq serve' /tmp/warmup.log || tail -20 /tmp/warmup.log
    serve $1 $2 before 1
    serve $1 $2 after 1
    # The api's processes apart from the rest of the change (after's default: one per four cores).
    [ $(left) -gt 200 ] && serve $1 $2 after-1-api 1 --api-workers 1
done
if [ "$DEVICE" = cuda ] && [ $(left) -gt 90 ]; then
    echo "=== GPU tests $(date +%T), ${SECONDS}s"
    PYTHONPATH=/tmp/site:$after timeout $(( $(left) - 60 )) python3 -m pytest -q -p no:cacheprovider -x -rfEs \
        tests/test_gpu_engine.py 2>&1 | tee "$OUT/tests.log" | tail -15
fi
set -- ${specs[0]}
[ $(left) -gt 60 ] && serve $1 $2 after 2
[ $(left) -gt 45 ] && serve $1 $2 before 2
echo "=== done ${SECONDS}s"
