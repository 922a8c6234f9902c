#!/bin/bash
# CPU ticks (1/100 s) of each process under the pid $1 (a `pagedq up`): "name ticks".
desc() { echo $1; for c in $(ps -o pid= --ppid $1); do desc $c; done; }
for p in $(desc $1); do n=$(tr '\0' ' ' < /proc/$p/cmdline | grep -oE "cli (api|worker)|core.process|redis-server|cli up" | tr ' ' _); echo "${n:-other} $(awk '{print $14+$15}' /proc/$p/stat)"; done
