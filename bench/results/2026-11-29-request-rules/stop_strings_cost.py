"""The detokenizer's time per token for one sequence with 1,024 stop strings (none of them
in the text), and with none, on the tiny model's tokenizer (`pagedq make-tiny-model /tmp/tinyl`).

    .venv/bin/python bench/results/2026-11-29-request-rules/stop_strings_cost.py
"""
import sys, time, random
import os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from transformers import AutoTokenizer
from pagedq.front.detokenizer import IncrementalDetokenizer
from pagedq.sampling_params import SamplingParams
tok = AutoTokenizer.from_pretrained("/tmp/tinyl")
rng = random.Random(0)
stops = [f"zq{i}x{rng.randrange(10**6)}" for i in range(1024)]
for label, params in (("1024 stop strings", SamplingParams(stop=stops)), ("none", SamplingParams())):
    d = IncrementalDetokenizer(tok, [5, 6, 7], params)
    ids = [rng.randrange(3, 500) for _ in range(400)]
    t = time.perf_counter()
    for t_id in ids:
        d.update([t_id])
    _ = d.output_text
    print(label, f"{(time.perf_counter() - t) / len(ids) * 1e6:.1f} us a token")
