#!/usr/bin/env bash
# The GPU check (issue 4), in one command on a CUDA machine:
#   bash bench/run_gpu.sh [OUT_DIR]
# 1. `pagedq bench kernels`: the Triton kernels against the reference on CUDA, then timed
#    against PyTorch SDPA on contiguous KV (and varlen_attn where present);
# 2. `pagedq bench offline --device cuda` on random-weight checkpoints of real shapes
#    (Qwen2.5-0.5B and Llama-3.2-1B, bf16) with nano-vllm's workload: pagedq vs transformers
#    generate_batch vs generate, side by side.
# Writes <date>-<gpu>-*.json and a summary .md into OUT_DIR (default bench/results).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
mkdir -p "$out"
pagedq=${PAGEDQ:-pagedq}
gpu=$(python3 -c 'import torch; print(torch.cuda.get_device_name(0).replace(" ", "-"))')
stem="$out/$(date +%Y-%m-%d)-$gpu"
models=${MODELS_DIR:-/tmp/pagedq-models}
summary="$stem.md"

{
  echo "# GPU check on $gpu, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  python3 -c 'import torch, transformers, triton; print(f"torch {torch.__version__}, transformers {transformers.__version__}, triton {triton.__version__}")'
  echo
  echo '```'
  echo "\$ $pagedq bench kernels --json $stem-kernels.json"
  $pagedq bench kernels --json "$stem-kernels.json"
  echo '```'
} 2>&1 | tee "$summary"

for preset in qwen2.5-0.5b llama-3.2-1b; do
  [ -f "$models/$preset/config.json" ] || $pagedq make-tiny-model "$models/$preset" --preset "$preset"
  cmd=("$pagedq" bench offline --model "$models/$preset" --device cuda --num-prompts 256
       --input-len 100:1024 --output-len 100:1024 --json "$stem-offline-$preset.json")
  {
    echo
    echo "## offline, $preset shape (random weights, bf16)"
    echo '```'
    echo "\$ ${cmd[*]}"
    "${cmd[@]}" 2>&1 | grep -v 'it/s\]$' | tr '\r' '\n' | grep -v '%|'
    echo '```'
  } | tee -a "$summary"
done
echo "wrote $summary and $stem-*.json"
