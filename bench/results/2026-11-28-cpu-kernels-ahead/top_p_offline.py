"""Offline SmolLM2 with top_p 0.9 (its generation_config default): the candidate top-p
against the full sort, alternated in one process.

    .venv/bin/python bench/results/2026-11-28-cpu-kernels-ahead/top_p_offline.py SMOLLM2_DIR
"""
import random
import sys
import time

import torch
torch.set_num_threads(1)
from pagedq import LLM, SamplingParams
import worker.sampler as sampler
fast = sampler._apply_top_p
llm = LLM(sys.argv[1], device="cpu")
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(32, 128))]} for _ in range(64)]
params = [SamplingParams(temperature=0.6, top_p=0.9, max_tokens=rng.randint(32, 128), ignore_eos=True, seed=i) for i in range(64)]
llm.generate(prompts[:2], params[:2], use_tqdm=False)
for rnd in range(2):
    for name, fn in (("sort", sampler._apply_top_p_sorted), ("candidates", fast)):
        sampler._apply_top_p = fn
        t, c = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        print(f"round {rnd} {name:10s} {n} tokens {wall:.1f} s {n / wall:.0f} tok/s cpu {cpu:.1f} s; first ids {outs[0].outputs[0].token_ids[:6]}", flush=True)
