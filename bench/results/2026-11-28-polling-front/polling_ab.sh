#!/bin/bash
# alternate base (e18decd) and head, polling, 3 rounds
for r in 1 2 3; do
  for tree in base head; do
    dir=/work/main; [ $tree = base ] && dir=/tmp/base
    echo "== round $r $tree load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $dir && /work/main/.venv/bin/python -m pagedq.cli bench serve --model /tmp/tinyl --device cpu --num-prompts 512 --no-stream --json bench/results/2026-11-28-polling-front/$tree-$r.json 2>&1 | grep -E "^pagedq|serve / offline|CPU seconds|engine steps")
  done
done
