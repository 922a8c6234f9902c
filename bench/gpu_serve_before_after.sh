#!/usr/bin/env bash
# Issue 23's GPU rows, before and after, on one lent GPU machine in one call:
#   bash bench/gpu_serve_before_after.sh BEFORE_TREE
# BEFORE_TREE: the earlier commit's files (e.g. `git archive COMMIT | tar -x -C .base`, carried
# with .whl/). For each model, a served run first fills Triton's kernel cache with every variant
# a served batch needs (an offline warm-up does not: on 2026-11-26 the side measured first paid
# 0.3-0.4 s more engine-core CPU and ~0.4 s more TTFT), then `pagedq bench serve` (its own Redis,
# api and worker; streaming clients; offline beside it) runs before, then after. Everything lands
# in $OUT.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
before=$(cd "$1" && pwd)
after=$PWD
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
run() {  # TREE SECONDS ARGS...: the CLI of that tree, for at most SECONDS
    local tree=$1 limit=$2; shift 2
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "$limit" python3 -m pagedq.cli "$@")
}
for spec in "bench-56m 32:256" "llama-3.2-1b 100:1024"; do
    set -- $spec
    model=/tmp/models/$1
    [ -d $model ] || run "$after" 300 make-tiny-model --preset $1 $model >/dev/null
    echo "=== $1: warm-up (served, fills the kernel cache) $(date +%T)"
    run "$after" 200 bench serve --model $model --device cuda --dtype bfloat16 --num-prompts 256 \
        --input-len $2 --output-len $2 --no-offline 2>&1 | grep '^pagedq serve'
    for side in before after; do
        tree=$after; [ $side = before ] && tree=$before
        echo "=== $1 serve --stream, $side $(date +%T)"
        run "$tree" 200 bench serve --model $model --device cuda --dtype bfloat16 --num-prompts 256 \
            --input-len $2 --output-len $2 --stream --json "$OUT/serve-$1-$side.json" 2>&1 \
            | grep -v 'it/s]\|pkg_resources\|^\s*$' | tail -9
    done
done
