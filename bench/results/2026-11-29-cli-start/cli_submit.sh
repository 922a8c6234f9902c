#!/bin/bash
# Wall seconds of a `pagedq submit` that finds no api (connection refused: the whole command but
# the request), for the tree in $1 with this checkout's .venv.
cd $1
/usr/bin/time -f "$(basename $1) pagedq submit (no api): %e s" env PYTHONPATH=$1 /work/main/.venv/bin/python -m pagedq.cli submit --url http://127.0.0.1:9 hi > /dev/null 2>> /tmp/cli_submit.err
tail -1 /tmp/cli_submit.err
