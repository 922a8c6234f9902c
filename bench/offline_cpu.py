"""Offline throughput and CPU of pagedq's `LLM` or vLLM's on `vllm bench serve`'s shape:
256 random-id prompts of 128 tokens, 128 output tokens each (ignore_eos), sampled at
temperature 1.0 (the servers' default: `vllm bench serve` no longer sends a temperature),
after a short warm-up. CPU is the whole process tree's (vLLM's engine core runs in a child process;
pagedq's here too, as the service runs it), so with bench/vllm_serve_compare.sh, which prints
each service's CPU on the same shape, it gives each engine's service / offline CPU.

    .venv/bin/python bench/offline_cpu.py pagedq [--model /tmp/hostm] [--rounds 3]
    ~/vllm-venv/bin/python bench/offline_cpu.py vllm [--model /tmp/hostm] [--rounds 3]

vLLM as bench/vllm_serve_compare.sh starts `vllm serve`: one OpenMP thread pinned to core 0
(VLLM_CPU_OMP_THREADS_BIND=0), a 2 GiB KV cache; pagedq with one torch thread, as its worker
runs on two cores."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tree_cpu import tree_cpu_seconds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engine", choices=["pagedq", "vllm"])
    parser.add_argument("--model", default="/tmp/hostm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    with open(os.path.join(args.model, "config.json")) as config:
        vocab_size = json.load(config)["vocab_size"]
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(128)]} for _ in range(256)]
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # bench/vllm_cli.py maps vllm-cpu's version to the one vLLM must read, on import.
        importlib.import_module("vllm_cli")
        from vllm import LLM, SamplingParams

        llm = LLM(model=args.model, dtype="float32", seed=0)
    else:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import torch

        from pagedq import LLM, SamplingParams

        torch.set_num_threads(1)
        llm = LLM(model=args.model, dtype="float32", device="cpu", seed=0, core_process=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=args.temperature, max_tokens=128, ignore_eos=True)
    for round_index in range(args.rounds):
        load = " ".join(open("/proc/loadavg").read().split()[:3])
        cpu, start = tree_cpu_seconds(os.getpid()), time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds, cpu = time.perf_counter() - start, tree_cpu_seconds(os.getpid()) - cpu
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        print(f"{args.engine} offline round {round_index + 1} (load before: {load}): {tokens} output tokens in "
              f"{seconds:.2f} s, {tokens / seconds:.0f} tok/s, process tree CPU {cpu:.2f} s", flush=True)


if __name__ == "__main__":  # vLLM starts its engine core by spawn, which imports this module again
    main()
