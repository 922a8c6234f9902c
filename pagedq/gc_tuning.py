"""The garbage collector in a long-lived serving process.

What a process builds while it starts (torch, transformers, the tokenizer: millions of
objects) lives as long as it does. Left in the collector's oldest generation, each full
collection walks all of it again: tens of milliseconds, at moments set by how much the
requests allocate, which showed as a spread of a factor of two in the api's CPU per
request across identical bursts. Frozen, the collector skips it; cycles made later are
still collected.

What a process allocates while it serves is almost all short-lived (a request's parsed
body, a step's outputs, an SSE frame), freed by reference counting before any collection
could look at it; what is left over is a few cycles. At the default youngest-generation
threshold (700 container allocations) the api collected 297 + 26 + 2 times (young, middle,
old) in a 512-request streaming run, 0.14 s of its ~1.8 s of CPU, each collection walking
the requests in flight; at 20,000, 6 times in 0.03 s (bench/results/2026-11-28-chunked-progress.md).
"""

from __future__ import annotations

import gc

# Container allocations (net of deallocations) between collections of the youngest generation.
YOUNG_GENERATION_THRESHOLD = 20_000


def freeze_startup_heap() -> None:
    """Collect once, then keep everything alive now out of every later collection, and
    collect the youngest generation less often (call when the process has finished starting)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, older, oldest)
