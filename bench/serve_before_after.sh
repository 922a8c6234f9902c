#!/bin/bash
# Serve vs offline on the tiny model, before and after a change, alternated (issue 23).
# usage: bench/serve_before_after.sh BEFORE_TREE AFTER_TREE [ROUNDS]
#   BEFORE_TREE: a checkout of the commit before (e.g. `git worktree add /tmp/base <commit>`);
#   both run with this checkout's .venv (the tree's own packages come first on sys.path).
# MODEL: a checkpoint directory (default /tmp/tinyl, made by `pagedq make-tiny-model /tmp/tinyl`).
# OUT: where the JSON goes (default bench/results/serve-before-after-*.json).
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$here/bench/results/serve-before-after}
for round in $(seq "${3:-2}"); do
  for side in before after; do
    tree=$1; [ $side = after ] && tree=$2
    for stream in stream no-stream; do
      echo "=== round $round $side ($tree) --$stream load: $(cut -d' ' -f1-3 /proc/loadavg)"
      (cd "$tree" && "$here/.venv/bin/python" -m pagedq.cli bench serve --model "${MODEL:-/tmp/tinyl}" --device cpu \
        --num-prompts 512 --$stream --json "$out-$side-$stream-$round.json" 2>&1 | grep -v "^\s*$" | tail -7)
    done
  done
done
