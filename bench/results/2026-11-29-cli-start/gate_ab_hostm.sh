#!/bin/bash
# Alternate two trees (A, B), ROUNDS rounds: bench serve on the negligible-compute model, 256 x 128/128, streaming.
for r in $(seq 1 ${ROUNDS:-3}); do
  for dir in $A $B; do
    echo "== round $r $dir load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $dir && /work/main/.venv/bin/python -m pagedq.cli bench serve --model /tmp/hostm --device cpu --num-prompts 256 \
      --input-len 128:128 --output-len 128:128 --stream --json /tmp/ab/$(basename $dir)-$r.json 2>&1 \
      | grep -E "^pagedq|serve / offline|CPU seconds|engine steps")
  done
done
