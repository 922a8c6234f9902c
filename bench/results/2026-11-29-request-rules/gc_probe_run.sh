#!/bin/bash
# GC time per process of a `pagedq up` over one `bench serve` run (512 streaming requests, tiny
# model), with and without gc.freeze() after warm-up: a temporary sitecustomize
# (gc_probe_sitecustomize.py, on PYTHONPATH for the service only) records each generation's
# collections and CPU time into $OUT_DIR every 0.5 s; FREEZE=1 freezes every process's heap once
# warm, GCTHRESH=a,b,c also sets gc thresholds then. Not part of the service.
#   FREEZE=1 bash bench/results/2026-11-29-request-rules/gc_probe_run.sh
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
PROBE=$(mktemp -d); cp "$HERE/gc_probe_sitecustomize.py" "$PROBE/sitecustomize.py"
export GC_PROBE_DIR=$PROBE
rm -rf /tmp/gcprobe/out /tmp/gcprobe/freeze; mkdir -p /tmp/gcprobe
export PAGEDQ_CACHE_DIR=$PROBE/cache PAGEDQ_MAX_QUEUE_DEPTH=2000 PYTHONPATH=$PROBE
.venv/bin/pagedq up --model /tmp/tinyl --device cpu --port 8311 > "$PROBE/up.log" 2>&1 &
UP=$!
for i in $(seq 120); do grep -q "http://" "$PROBE/up.log" && break; sleep 1; done
unset PYTHONPATH
.venv/bin/pagedq bench serve --model /tmp/tinyl --url http://127.0.0.1:8311 --num-prompts 64 --no-offline --stream > /dev/null 2>&1
[ -n "$FREEZE" ] && touch /tmp/gcprobe/freeze
sleep 1.5; head /tmp/gcprobe/out/*
bash "$HERE/tree_cpu_by_process.sh" $UP > "$PROBE/before"
.venv/bin/pagedq bench serve --model /tmp/tinyl --url http://127.0.0.1:8311 --num-prompts 512 --no-offline --stream 2>&1 | grep -E "pagedq serve"
sleep 1.5; head /tmp/gcprobe/out/*
bash "$HERE/tree_cpu_by_process.sh" $UP > "$PROBE/after"
paste "$PROBE/before" "$PROBE/after" | awk '{printf "%s %s %.2f s\n", $1, $2, ($4-$2)/100}'
rm -f /tmp/gcprobe/freeze
kill -TERM $UP; wait $UP
