"""The garbage collector of a serving process (pagedq.gc_tuning), in a process of its own
so that the test run's collector is left as it is."""

from __future__ import annotations

import subprocess
import sys

_COUNT_COLLECTIONS = """
import gc, sys
from pagedq.gc_tuning import freeze_startup_heap
if sys.argv[1] == "tuned":
    freeze_startup_heap()
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
kept = []
for i in range(10_000):
    body = {"prompt": [i, i + 1], "sampling": {"n": 1}}  # short-lived, as a request's parsed body
    if i % 4 == 0:
        kept.append(body)  # and some that live on (requests in flight)
print(len(collections))
"""


def collections_in_a_burst(mode: str) -> int:
    run = subprocess.run([sys.executable, "-c", _COUNT_COLLECTIONS, mode], capture_output=True, text=True, check=True)
    return int(run.stdout)


def test_a_serving_process_does_not_collect_during_a_burst_of_short_lived_objects():
    assert collections_in_a_burst("default") >= 5
    assert collections_in_a_burst("tuned") == 0
