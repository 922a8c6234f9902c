#!/bin/bash
# Alternate base (a git worktree at $BASE, default /tmp/base: 83ea846, this session's start)
# and head (this checkout), ROUNDS rounds (default 3), MODE --no-stream (polling clients, the
# default) or --stream; each run with its own offline run, the load average printed before it.
# JSON per run under $OUT (default this folder). Run from /work/main.
out=${OUT:-bench/results/2026-11-29-burst-pipeline/ab}
mode=${MODE:---no-stream}
mkdir -p $out
for r in $(seq 1 ${ROUNDS:-3}); do
  for tree in base head; do
    dir=/work/main; [ $tree = base ] && dir=${BASE:-/tmp/base}
    echo "== round $r $tree load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $dir && /work/main/.venv/bin/python -m pagedq.cli bench serve --model /tmp/tinyl --device cpu --num-prompts 512 \
      $mode --json /work/main/$out/$tree$mode-$r.json 2>&1 \
      | grep -E "^pagedq|serve / offline|CPU seconds|engine steps|streamed")
  done
done
