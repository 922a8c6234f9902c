#!/bin/bash
# usage: OUT=DIR ab.sh ROUNDS MODE name=tree ...   (bench serve from each tree, alternating the order per round)
ROUNDS=$1; MODE=$2; shift 2
for r in $(seq 1 $ROUNDS); do
  if (( r % 2 )); then set -- "$@"; order="$*"; else order=$(printf '%s\n' "$@" | tac | tr '\n' ' '); fi
  for nt in $order; do
    name=${nt%%=*}; tree=${nt#*=}
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    out=$(cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python -m pagedq.cli bench serve --model /tmp/tinyl --device cpu --num-prompts 512 --$MODE --json $OUT/$name-$MODE-$r.json 2>&1)
    echo "$name $MODE r$r load[$load]: $(echo "$out" | grep -E '^serve / offline' ) | $(echo "$out" | grep -E '^CPU seconds' | sed 's/CPU seconds of the timed serve run: //')"
  done
done
