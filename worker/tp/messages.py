"""What the leader (rank 0) sends ranks 1..N-1 over each one's stdin: how to start, then
each step's block moves and forwards, as msgpack (msgspec) frames, each behind its
4-byte length. Plain data only: nothing read here can execute code."""

from __future__ import annotations

import struct
from typing import BinaryIO

import msgspec

from worker.input_batch import StepPlan

_LENGTH = struct.Struct("<I")


class RankStart(msgspec.Struct, array_like=True, gc=False):
    rank: int
    size: int
    store_port: int  # the leader's torch.distributed TCP store, on localhost
    engine_args: dict  # pagedq.config.EngineArgs' fields
    # Rank 0's model config (transformers' to_dict()): every rank builds its shard from the
    # same values, and none pays for importing transformers to read it again.
    hf_config: dict
    max_model_len: int
    torch_threads: int


class RunForward(msgspec.Struct, array_like=True, gc=False, tag=True):
    """A StepPlan less its owners (the engine core's sequences, which no rank reads)."""

    rows: list[int]
    starts: list[int]
    query_lens: list[int]
    token_ids: list[int]
    pending_at: list[int]
    pending_from: list[int]
    logits_of: list[int]
    changed_rows: list[tuple[int, list[int]]]
    # Every rank gathers the same logits rows (the LM head is split by vocabulary).
    extra_logits: list[int]

    @classmethod
    def of(cls, plan: StepPlan) -> RunForward:
        return cls(plan.rows, plan.starts, plan.query_lens, plan.token_ids, plan.pending_at, plan.pending_from,
                   plan.logits_of, plan.changed_rows, plan.extra_logits)

    def plan(self) -> StepPlan:
        return StepPlan(self.rows, self.starts, self.query_lens, self.token_ids, self.pending_at, self.pending_from,
                        self.logits_of, self.changed_rows, owners=[], extra_logits=self.extra_logits)


class MoveBlocks(msgspec.Struct, array_like=True, gc=False, tag=True):
    """A step's KV block moves, in the order the model runner applies them."""

    swap_out: list[tuple[int, int]]
    block_copies: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]


Command = RunForward | MoveBlocks


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(_LENGTH.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame; None at the end of the stream (the leader is gone or let go)."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    payload = stream.read(length)
    return payload if len(payload) == length else None
