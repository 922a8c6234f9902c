#!/bin/bash
# Issue 23's CPU targets at the head: bench serve on the tiny model, streaming and polling
# alternated, then the stream-interval frontier (PAGEDQ_STREAM_INTERVAL_S), each run with the
# load average before it. MODEL: default /tmp/tinyl (`pagedq make-tiny-model /tmp/tinyl`).
cd "$(dirname "$0")/../../.."
out=bench/results/2026-12-07-issue-23-close
run() {  # name, then env assignments and bench flags
  local name=$1; shift
  echo "=== $name load: $(cut -d' ' -f1-3 /proc/loadavg)"
  env "$@" .venv/bin/pagedq bench serve --model "${MODEL:-/tmp/tinyl}" --device cpu --num-prompts 512 \
    --json "$out/$name.json" ${FLAGS} 2>&1 | grep -v "^\s*$" | tail -8
}
for round in 1 2 3; do
  FLAGS=--stream run "stream-$round" PAGEDQ_STREAM_INTERVAL_S=0
  FLAGS=--no-stream run "poll-$round" PAGEDQ_STREAM_INTERVAL_S=0
done
for interval in 0.02 0.05 0.1; do
  FLAGS=--stream run "stream-interval-$interval" PAGEDQ_STREAM_INTERVAL_S=$interval
done
