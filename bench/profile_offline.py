"""Where the offline engine's time goes: one greedy pass over the `bench offline` workload
(64 prompts, lengths 32-256) under cProfile, top functions by own time; with --ops, under
torch.profiler instead, top operators (matmuls, kernels, elementwise ops) by own time.

    .venv/bin/python bench/profile_offline.py --model /tmp/bench56 --threads 1 [--backend torch] [--dtype bfloat16] [--ops]

One thread makes the split readable on a shared machine (each op's time is its own, not
waits on a busy sibling thread). Model load and a short warm-up are not profiled.
"""

import argparse
import cProfile
import os
import pstats
import time

import torch

from pagedq import LLM, SamplingParams
from pagedq.bench.workload import LengthRange, make_workload

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--device", default="cpu", help="cpu or cuda (on CUDA the profile shows the host's share of a step)")
parser.add_argument("--backend", default="auto", help="attention backend: auto, cpu, torch or triton")
parser.add_argument("--dtype", default="float32")
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--num-prompts", type=int, default=64)
parser.add_argument("--max-len", type=int, default=256, help="prompt and output lengths are uniform in 32..this")
parser.add_argument("--top", type=int, default=15)
parser.add_argument("--ops", action="store_true", help="profile operators with torch.profiler instead of Python functions")
args = parser.parse_args()

torch.set_num_threads(args.threads)
llm = LLM(model=args.model, dtype=args.dtype, device=args.device, attention_backend=args.backend)
workload = make_workload(args.num_prompts, LengthRange(32, args.max_len), LengthRange(32, args.max_len),
                         llm.llm_engine.vocab_size, seed=0, temperature=0.0)
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
prompts = [{"prompt_token_ids": p} for p in workload.prompts]
llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)

start = time.perf_counter()
if args.ops:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as ops:
        outputs = llm.generate(prompts, params, use_tqdm=False)
else:
    python_profile = cProfile.Profile()
    python_profile.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    python_profile.disable()
seconds = time.perf_counter() - start
tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
print(f"attention {llm.llm_engine.core_info.attention_backend}, {args.dtype}, {args.threads} threads: {tokens} tokens "
      f"in {seconds:.2f} s = {tokens / seconds:.1f} tok/s (under the profiler); load average {os.getloadavg()[0]:.2f}")
if args.ops:
    print(ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
else:
    pstats.Stats(python_profile).sort_stats("tottime").print_stats(args.top)
