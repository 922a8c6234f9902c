# Call 3 of 2026-11-28 (bench/results/2026-11-28-h200-serve.md): more rounds of the 56m row on a
# fresh lent H200 (.whl/ carried), a served warm-up first; each round's log and JSON under $OUT.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -d /tmp/site/rq ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
M=/tmp/models/m-bench-56m; python3 -m pagedq.cli make-tiny-model --preset bench-56m $M >/dev/null 2>&1
echo "=== warm-up ${SECONDS}s"
timeout 80 python3 -m pagedq.cli bench serve --model $M --device cuda --dtype bfloat16 --num-prompts 256 --input-len 32:256 --output-len 32:256 --stream --no-offline 2>&1 | grep -E "^pagedq|CPU seconds"
for r in 3 4 5; do [ $SECONDS -lt 160 ] && { echo "=== 56m r$r $(date +%T) ${SECONDS}s"; timeout 65 python3 -m pagedq.cli bench serve --model $M --device cuda --dtype bfloat16 --num-prompts 256 --input-len 32:256 --output-len 32:256 --stream --json $OUT/r$r.json > $OUT/r$r.log 2>&1; grep -E "^pagedq|serve / offline|CPU seconds" $OUT/r$r.log; }; done
echo "=== done ${SECONDS}s"
