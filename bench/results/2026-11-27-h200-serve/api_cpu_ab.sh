#!/bin/bash
# api CPU around one `vllm bench serve` (256 x 128/128, OpenAI streaming) against `pagedq up` from TREE.
# Usage: api_cpu_ab.sh TREE PORT SEED (TREE: a checkout with .venv; needs ~/vllm-venv and /tmp/hostm).
tree=$1; port=$2; seed=$3
cd $tree
HOME=/tmp/uphome-$port setsid .venv/bin/python -m pagedq.cli up --model /tmp/hostm --port $port > /tmp/up-$port.log 2>&1 &
up=$!
for i in $(seq 300); do curl -sf http://127.0.0.1:$port/ready >/dev/null && break; sleep 1; done
bench() { HF_HUB_OFFLINE=1 ~/vllm-venv/bin/python bench/vllm_cli.py bench serve --backend openai --base-url http://127.0.0.1:$port --endpoint /v1/completions --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts $1 --ignore-eos --model /tmp/hostm --tokenizer /tmp/hostm --seed $2 2>&1 | grep -E "Output token throughput|Median TTFT" | awk '{printf "%s ", $NF}'; }
bench 32 99 > /dev/null
api=$(pgrep -f "pagedq.cli api" | head -1)
cpu() { awk '{print $14+$15}' /proc/$api/stat; }
a=$(cpu); r=$(bench 256 $seed); b=$(cpu)
echo "$(basename $tree) tok/s,TTFT: $r api CPU s: $(python3 -c "print(round(($b-$a)/100, 2))") load $(cut -d' ' -f1 /proc/loadavg)"
kill -INT -- -$up; wait $up 2>/dev/null
