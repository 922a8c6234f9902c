#!/bin/bash
# Seconds from `pagedq worker` launch to RQ's "Listening on" line, for the tree in $1 (its own code on
# PYTHONPATH, this checkout's .venv). Needs redis-server on port 6399 and the tiny model at /tmp/tinyl.
cd $1
export PAGEDQ_REDIS_URL=redis://127.0.0.1:6399/0 PYTHONPATH=$1
start=$(date +%s.%N)
/work/main/.venv/bin/python -m pagedq.cli worker --model /tmp/tinyl --device cpu > /tmp/wr.log 2>&1 &
wp=$!
while ! grep -q "Listening on" /tmp/wr.log; do sleep 0.05; done
end=$(date +%s.%N)
echo "$(basename $1) ready $(echo "$end - $start" | bc) s load $(cut -d' ' -f1 /proc/loadavg)"
kill -INT $wp; wait $wp 2>/dev/null
