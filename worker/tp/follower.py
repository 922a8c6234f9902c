"""Ranks 1..N-1 of a tensor-parallel engine: `python -m worker.tp.follower`, started by
rank 0 (worker.tp.leader), its RankStart then its commands on stdin.

It builds the same model runner as rank 0 on its own shard (the model, the KV cache of
its heads, the persistent input batch, CUDA graphs), then runs each block move and
forward it is sent; the collectives inside pair with rank 0's. It never samples: the
logits it computes are dropped. It leaves when its stdin ends; anything that throws ends
the process, whose closed sockets end rank 0's step too.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import SimpleNamespace


def main() -> None:
    # Rank 0's process acts on signals (a worker draining after SIGTERM still needs its
    # ranks); this one ends with its stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("PAGEDQ_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s tp-rank %(levelname)s %(name)s: %(message)s")
    import msgspec
    import torch

    from pagedq.config import EngineArgs
    from worker.model_runner import ModelRunner, resolve_device
    from worker.tp.group import join_group, leave_group, open_store
    from worker.tp.messages import Command, MoveBlocks, RankStart, read_frame

    stdin = sys.stdin.buffer
    frame = read_frame(stdin)
    if frame is None:
        return
    start = msgspec.msgpack.decode(frame, type=RankStart)
    torch.set_num_threads(start.torch_threads)
    args = EngineArgs(**start.engine_args)
    store = open_store(start.size, start.store_port)
    store.set(f"joining/{start.rank}", "1")
    tp = join_group(store, start.rank, start.size, resolve_device(args.device).type)
    try:
        runner = ModelRunner(args, SimpleNamespace(**start.hf_config), start.max_model_len, set(), tp=tp)
        decoder = msgspec.msgpack.Decoder(Command)
        with torch.inference_mode():
            while (frame := read_frame(stdin)) is not None:
                command = decoder.decode(frame)
                if isinstance(command, MoveBlocks):
                    runner.move_blocks(command)
                else:
                    runner.forward(command.plan())
    finally:
        leave_group()


if __name__ == "__main__":
    main()
