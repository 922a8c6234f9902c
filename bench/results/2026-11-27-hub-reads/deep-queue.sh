#!/bin/bash
# bench serve, 2,048 streaming requests at once (up to 2,048 streams followed, most of them queued), alternated trees.
for r in 1 2; do
  if (( r % 2 )); then order="before=/tmp/tree-8174aa2 after=/tmp/tree-cb09d9d"; else order="after=/tmp/tree-cb09d9d before=/tmp/tree-8174aa2"; fi
  for nt in $order; do
    name=${nt%%=*}; tree=${nt#*=}
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    out=$(cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python -m pagedq.cli bench serve --model /tmp/tinyl --device cpu --num-prompts 2048 --stream --no-offline --json /tmp/ab4/$name-$r.json 2>&1)
    echo "$name r$r load[$load]: $(echo "$out" | grep -E '^pagedq serve' | tr -s ' ') | $(echo "$out" | grep -E '^CPU seconds' | sed 's/CPU seconds of the timed serve run: //')"
  done
done
