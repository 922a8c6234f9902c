# The sequence of call 2 (bench/results/2026-11-27-h200-serve.md), run from the repository root
# on a lent GPU machine with .whl/ and .base/ (before = 33b570a) carried: DEADLINE=200 bash bench/results/2026-11-27-h200-serve/call2.sh
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DEADLINE=${DEADLINE:-205}
rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
here=$PWD; before=$PWD/.base
left() { echo $((DEADLINE - SECONDS)); }
cli() { local tree=$1 limit=$2; shift 2; (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "$limit" python3 -m pagedq.cli "$@"); }
echo "=== test ${SECONDS}s"
PYTHONPATH=/tmp/site:$here timeout 40 python3 -m pytest -q -p no:cacheprovider -x -rfEs tests/test_gpu_engine.py -k "intact" 2>&1 | tail -4
M=/tmp/models/bench-56m; cli $here 60 make-tiny-model --preset bench-56m $M >/dev/null 2>&1
(while true; do echo "@ $(date +%T.%N | cut -c1-12)"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1; ps -eo pid,ppid,ni,pcpu,etimes,args | grep -E "pagedq" | grep -v grep | cut -c1-110; sleep 0.5; done) > $OUT/monitor.log 2>&1 &
serve() { echo "=== serve $1 ($2) $(date +%T.%N | cut -c1-12) ${SECONDS}s"; cli $1 120 bench serve --model $M --device cuda --dtype bfloat16 --num-prompts 256 --input-len 32:256 --output-len 32:256 --stream > /tmp/s.log 2>&1; cat /tmp/s.log >> $OUT/all.log; grep -E "^pagedq|serve /|CPU sec|error|Error" /tmp/s.log | tail -6; echo "    ended $(date +%T.%N | cut -c1-12)"; }
serve $here after-warm
if [ $(left) -gt 70 ]; then echo "=== offline alone, after ${SECONDS}s"; cli $here 60 bench offline --model $M --device cuda --dtype bfloat16 --num-prompts 256 --input-len 32:256 --output-len 32:256 --peers pagedq --rounds 2 2>&1 | grep -E "^pagedq|tok/s" | tail -3; fi
[ $(left) -gt 55 ] && serve $before before
[ $(left) -gt 50 ] && serve $here after
echo "=== done ${SECONDS}s"
