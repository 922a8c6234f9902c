"""The garbage collector in a long-lived serving process.

What a process builds while it starts (torch, transformers, the tokenizer: millions of
objects) lives as long as it does. Left in the collector's oldest generation, each full
collection walks all of it again: tens of milliseconds, at moments set by how much the
requests allocate, which showed as a spread of a factor of two in the api's CPU per
request across identical bursts. Frozen, the collector skips it; cycles made later are
still collected.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then keep everything alive now out of every later collection (call when
    the process has finished starting)."""
    gc.collect()
    gc.freeze()
