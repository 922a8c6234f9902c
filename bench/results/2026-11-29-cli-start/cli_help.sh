#!/bin/bash
# Wall seconds of `pagedq COMMAND --help` (the parser a process builds before its command runs),
# for the tree in $1 with this checkout's .venv.
cd $1
for c in "api" "worker" "submit" "bench serve"; do
  /usr/bin/time -f "$(basename $1) pagedq $c --help: %e s" env PYTHONPATH=$1 /work/main/.venv/bin/python -m pagedq.cli $c --help > /dev/null 2>> /tmp/cli_help.err
done
tail -4 /tmp/cli_help.err
