#!/bin/bash
# `vllm bench serve` (256 x 128/128, ignore_eos, /v1/completions streaming) against `pagedq up`
# from base (365f8ca, a git worktree at /tmp/base) and head, and `vllm serve`, on the host-bench
# checkpoint (/tmp/hostm), alternated; as bench/vllm_serve_compare.sh, with the base tree added.
# The load average before each run; each service's process-tree CPU during its benchmark.
cd /work/main
MODEL=${MODEL:-/tmp/hostm}; VLLM_PY=${VLLM_PY:-$HOME/vllm-venv/bin/python}; ROUNDS=${ROUNDS:-2}
export HF_HUB_OFFLINE=1
bench() {
  local before; before=$(python3 bench/tree_cpu.py "$3")
  $VLLM_PY bench/vllm_cli.py bench serve --backend openai --base-url "http://127.0.0.1:$1" --endpoint /v1/completions \
    --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts 256 --ignore-eos \
    --model "$MODEL" --tokenizer "$MODEL" --seed "$2" 2>&1 | grep -E "Successful|Output token throughput|Median TTFT|Median TPOT"
  echo "service CPU seconds during the benchmark: $(python3 -c "print(f'{$(python3 bench/tree_cpu.py "$3") - $before:.1f}')")"
}
wait_for() { for _ in $(seq 600); do curl -sf "$1" > /dev/null && return 0; sleep 1; done; return 1; }
for round in $(seq "$ROUNDS"); do
  for tree in base head; do
    dir=/work/main; [ $tree = base ] && dir=/tmp/base
    echo "=== round $round pagedq up ($tree); load: $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $dir && exec setsid /work/main/.venv/bin/python -m pagedq.cli up --model "$MODEL" --port 8021 > /tmp/pagedq-up-$tree.log 2>&1) &
    up=$!
    wait_for http://127.0.0.1:8021/ready && bench 8021 "$round" "$up"
    kill -INT -- -$up; wait $up
    sleep 2
  done
  echo "=== round $round vllm serve; load: $(cut -d' ' -f1-3 /proc/loadavg)"
  VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0 setsid $VLLM_PY bench/vllm_cli.py serve "$MODEL" --port 8022 \
    --dtype float32 > /tmp/vllm-serve.log 2>&1 &
  vllm=$!
  wait_for http://127.0.0.1:8022/v1/models && bench 8022 "$round" "$vllm"
  kill -INT -- -$vllm 2>/dev/null; wait $vllm
done
