#!/bin/bash
# `pagedq up` on the tiny model, one warm-up `bench serve --url` run, then py-spy (100 Hz,
# --nonblocking) on the api and the worker through a second streaming run of 512 requests.
# Writes under /tmp/prof (make it first); summarise with bench/pyspy_summary.py.
cd /work/main
.venv/bin/pagedq up --model /tmp/tinyl --device cpu --port 8123 --disable-uvicorn-access-log > /tmp/prof/up.log 2>&1 &
U=$!
for i in $(seq 1 300); do grep -q "pagedq is up" /tmp/prof/up.log && break; sleep 0.2; done
A=$(grep -o "Started server process \[[0-9]*" /tmp/prof/up.log | grep -o "[0-9]*$"); W=$(grep -o "started with PID [0-9]*" /tmp/prof/up.log | grep -o "[0-9]*$")
echo "api $A worker $W"
.venv/bin/pagedq bench serve --model /tmp/tinyl --url http://127.0.0.1:8123 --no-offline --num-prompts 512 --stream > /tmp/prof/b1.log 2>&1
.venv/bin/py-spy record --pid $A --format raw -r 100 -d 9 -o /tmp/prof/api.txt --nonblocking > /dev/null 2>&1 &
.venv/bin/py-spy record --pid $W --format raw -r 100 -d 9 -o /tmp/prof/worker.txt --nonblocking > /dev/null 2>&1 &
sleep 0.5
.venv/bin/pagedq bench serve --model /tmp/tinyl --url http://127.0.0.1:8123 --no-offline --num-prompts 512 --stream > /tmp/prof/b2.log 2>&1
wait %2 %3 2>/dev/null; sleep 9
kill -INT $U; wait $U
tail -5 /tmp/prof/b1.log; tail -5 /tmp/prof/b2.log
