#!/bin/bash
# Alternate base (365f8ca, from a git worktree at /tmp/base) and head, streaming clients,
# ROUNDS rounds (default 3); each run with its own offline run. Run from /work/main.
out=bench/results/2026-11-28-announced-deltas
for r in $(seq 1 ${ROUNDS:-3}); do
  for tree in base head; do
    dir=/work/main; [ $tree = base ] && dir=/tmp/base
    echo "== round $r $tree load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $dir && /work/main/.venv/bin/python -m pagedq.cli bench serve --model /tmp/tinyl --device cpu --num-prompts 512 \
      ${MODE:---stream} --json /work/main/$out/$tree${MODE:---stream}-$r.json 2>&1 \
      | grep -E "^pagedq|serve / offline|CPU seconds|engine steps|streamed")
  done
done
