"""CPU seconds (user + system) of a process and all its live descendants, from /proc.

    python bench/tree_cpu.py PID

A server's whole tree: `pagedq up`'s Redis, api, worker and engine core; `vllm serve`'s api
server and engine core. Two readings around a benchmark give the CPU the whole service spent
on it (processes that exit between the readings are not counted; neither server's do during
a run)."""

import os
import sys


def _stats() -> dict[int, tuple[int, int]]:
    """Every live process: (parent pid, CPU ticks)."""
    stats = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                # The command name (field 2) may hold spaces: the fields after it follow its ")".
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
        stats[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return stats


def tree_cpu_seconds(root: int) -> float:
    stats = _stats()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    ticks, todo = 0, [root]
    while todo:
        pid = todo.pop()
        ticks += stats.get(pid, (0, 0))[1]
        todo += children.get(pid, [])
    return ticks / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    print(f"{tree_cpu_seconds(int(sys.argv[1])):.2f}")
