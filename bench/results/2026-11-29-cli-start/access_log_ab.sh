#!/bin/bash
# `pagedq bench serve` (tiny model, 512 requests at once) with uvicorn's access log on (the default)
# and off (PAGEDQ_DISABLE_UVICORN_ACCESS_LOG), alternated, ROUNDS times; MODE=--no-stream|--stream.
cd /work/main
for r in $(seq ${ROUNDS:-3}); do
  for off in false true; do
    echo "== access log off: $off, round $r, load $(cut -d' ' -f1-3 /proc/loadavg)"
    PAGEDQ_DISABLE_UVICORN_ACCESS_LOG=$off .venv/bin/pagedq bench serve --model /tmp/tinyl --device cpu --num-prompts 512 ${MODE:---no-stream} --json /work/main/bench/results/2026-11-29-cli-start/access-log-${off}-r${r}${MODE}.json \
      2>&1 | grep -E "^pagedq |CPU seconds|serve / offline|streamed"
  done
done
