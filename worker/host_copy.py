"""Copies between host and device that never make the host wait for the device's queue.

With overlapped steps the device is always busy with a step the host queued earlier. A
plain `.tolist()` of a CUDA tensor would enqueue its copy behind everything queued and
wait for all of it; so `HostCopy` queues the copy into pinned memory right after the work
that produces the tensors, with an event behind it, and the host later waits for that
event alone. The other way, `torch.tensor(values, device="cuda")` copies from pageable
memory, which synchronizes the stream: the host would stall until the device finished
the step before (the H200 profile's 3.3 s of `torch.tensor`); `to_device` stages the
values in pinned memory and copies without waiting. On a CPU both are plain tensors.
"""

from __future__ import annotations

import torch


class HostCopy:
    def __init__(self, tensors: list[torch.Tensor]):
        if not tensors or tensors[0].device.type != "cuda":
            self._host, self._event = tensors, None
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
        self._event = torch.cuda.Event()
        self._event.record()

    def lists(self) -> list[list]:
        """The tensors as Python lists, once their copy has arrived."""
        if self._event is not None:
            self._event.synchronize()
        return [t.tolist() for t in self._host]


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list (indices, per-row settings) as a tensor on `device`, copied
    without waiting for the device's queue."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
