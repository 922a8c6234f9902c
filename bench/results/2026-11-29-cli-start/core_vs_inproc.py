"""The same offline workload (the serve bench's: 512 prompts, 32-256 in and out, temperature 0.6,
ignore_eos) through LLM.generate with the engine core in process and in its own process; CPU
seconds of this process and of the core's. python core_vs_inproc.py MODEL ROUNDS"""
import os, random, sys, time
import psutil
from pagedq import LLM, SamplingParams
model, rounds = sys.argv[1], int(sys.argv[2])
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(rng.randint(32, 256))]} for _ in range(512)]
params = [SamplingParams(temperature=0.6, max_tokens=rng.randint(32, 256), ignore_eos=True, seed=i) for i in range(512)]
def cpu(p): t = p.cpu_times(); return t.user + t.system
llms = {name: LLM(model, dtype="float32", device="cpu", core_process=flag) for name, flag in (("in-process", False), ("core process", True))}
me = psutil.Process()
for r in range(rounds):
    for name, llm in llms.items():
        kids = me.children(recursive=True)
        before = cpu(me) + sum(cpu(k) for k in kids); t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        after = cpu(me) + sum(cpu(k) for k in kids)
        print(f"round {r} {name:12s}: wall {wall:.2f} s, CPU {after - before:.2f} s (load {os.getloadavg()[0]:.2f})")
