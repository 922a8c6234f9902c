#!/bin/bash
# Seconds from `pagedq api` launch to uvicorn's "Application startup complete", for the tree in $1 (its
# own code on PYTHONPATH, this checkout's .venv). Needs redis-server on port 6399 and the tiny model at /tmp/tinyl.
cd $1
export PAGEDQ_REDIS_URL=redis://127.0.0.1:6399/0 PYTHONPATH=$1
start=$(date +%s.%N)
/work/main/.venv/bin/python -m pagedq.cli api --model /tmp/tinyl --port 8199 --workers 1 > /tmp/ar.log 2>&1 &
ap=$!
while ! grep -q "Application startup complete" /tmp/ar.log; do sleep 0.02; done
end=$(date +%s.%N)
echo "$(basename $1) api ready $(echo "$end - $start" | bc) s load $(cut -d' ' -f1 /proc/loadavg)"
kill -TERM $ap; wait $ap 2>/dev/null
