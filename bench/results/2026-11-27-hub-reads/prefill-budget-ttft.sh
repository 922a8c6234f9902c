#!/bin/bash
# TTFT of `vllm bench serve` 256 x 128/128 against `pagedq up` at two prefill budgets, alternated.
cd /work/main
MODEL=/tmp/hostm; VLLM_PY=$HOME/vllm-venv/bin/python
export HF_HUB_OFFLINE=1
wait_for() { for _ in $(seq 600); do curl -sf "$1" > /dev/null && return 0; sleep 1; done; return 1; }
for budget in 2048 4096 4096 2048; do
  echo "=== max_num_batched_tokens $budget; load: $(cut -d' ' -f1-3 /proc/loadavg)"
  PAGEDQ_MAX_NUM_BATCHED_TOKENS=$budget setsid .venv/bin/pagedq up --model "$MODEL" --port 8021 > /tmp/pagedq-up.log 2>&1 &
  up=$!
  wait_for http://127.0.0.1:8021/ready && $VLLM_PY bench/vllm_cli.py bench serve --backend openai --base-url http://127.0.0.1:8021 --endpoint /v1/completions \
    --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts 256 --ignore-eos \
    --model "$MODEL" --tokenizer "$MODEL" --seed 1 2>&1 | grep -E "Output token throughput|Median TTFT|Median TPOT"
  kill -INT -- -$up; wait $up
done
