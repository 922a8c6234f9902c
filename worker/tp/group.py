"""A rank's place in its tensor-parallel group, and the group's collectives.

`SINGLE` (one rank) is what every model is built with unless told otherwise: each
collective is then skipped by a size check, so one device runs exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a collective may wait for the other ranks. A rank that dies is noticed at once
# (its sockets close: gloo raises); this bounds the rest, e.g. a rank stuck in a kernel.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, MLP columns); shapes that do not divide are refused."""
        if total % self.size:
            raise ValueError(
                f"tensor_parallel_size {self.size} must divide the model's {what} ({total})"
            )
        return total // self.size

    def kv_heads(self, num_kv_heads: int, num_heads: int) -> tuple[int, int]:
        """(KV heads this rank holds, the first of them). With fewer KV heads than ranks each
        KV head is replicated on the ranks whose query heads read it (as vLLM does)."""
        self.split(num_heads, "num_attention_heads")
        if num_kv_heads % self.size == 0:
            local = num_kv_heads // self.size
            return local, self.rank * local
        if self.size % num_kv_heads == 0:
            return 1, self.rank * num_kv_heads // self.size
        raise ValueError(
            f"tensor_parallel_size {self.size} and the model's num_key_value_heads ({num_kv_heads}) must divide "
            f"one another"
        )

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first vocabulary row of this rank, rows per rank): the last rank's shard is padded."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    def device(self, device: torch.device) -> torch.device:
        """Rank r of a CUDA group drives GPU r of the machine."""
        if self.size > 1 and device.type == "cuda":
            return torch.device("cuda", self.rank)
        return device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place: the row-parallel layers' partial products."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's [rows, columns] side by side: the full vocabulary's logits."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' values (the KV cache's blocks: every rank holds as many)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


SINGLE = TensorParallel()


def open_store(size: int, port: int = 0, is_leader: bool = False) -> dist.TCPStore:
    """Where the ranks find one another: the leader's TCP store on localhost (the ranks of
    one engine share a machine), on a free port the leader passes to the others."""
    return dist.TCPStore("127.0.0.1", port, size, is_master=is_leader, wait_for_workers=False,
                         timeout=COLLECTIVE_TIMEOUT)


def join_group(store: dist.TCPStore, rank: int, size: int, device_type: str) -> TensorParallel:
    """Join the process's default group (so one tensor-parallel engine per process)."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)  # NCCL's communicator binds to the current device
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size)


def leave_group() -> None:
    """Tear the group down; after a rank died, this is what keeps the process from
    aborting at exit on the group's broken sockets."""
    if dist.is_initialized():
        dist.destroy_process_group()
