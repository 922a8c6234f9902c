#!/bin/bash
# Serve vs offline on the tiny model, the worker's engine core in-process (before) or in its own process (after), alternated.
# MODEL: a checkpoint directory (default /tmp/tinyl, made by `pagedq make-tiny-model /tmp/tinyl`).
cd "$(dirname "$0")/.."
for round in 1 2 3; do
  for cp in false true; do
    for stream in stream no-stream; do
      [ $stream = no-stream ] && [ $round = 3 ] && continue
      echo "=== round $round core_process=$cp $stream load: $(cut -d' ' -f1-3 /proc/loadavg)"
      PAGEDQ_CORE_PROCESS=$cp .venv/bin/pagedq bench serve --model "${MODEL:-/tmp/tinyl}" --device cpu --num-prompts 512 --$stream \
        --json bench/results/2026-11-26-serve-core-process-$cp-$stream-$round.json 2>&1 | grep -v "^\s*$" | tail -12
    done
  done
done
