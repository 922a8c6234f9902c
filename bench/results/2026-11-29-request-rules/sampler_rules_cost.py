"""What one request's token rules cost every step of its batch: Sampler.sample's time per
step, 64 rows over a 49,152-token vocabulary (SmolLM2's), one CPU thread; one request of
n=8 rows with a long list, the other 56 rows plain greedy. The sampler of a git commit
(BEFORE, default fd6519b) against this tree's, alternated, min and median of 5 rounds.

    .venv/bin/python bench/results/2026-11-29-request-rules/sampler_rules_cost.py [BEFORE]
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from pagedq.sampling_params import SamplingParams  # noqa: E402
from tests.test_sampler import Row  # noqa: E402  (the sampler tests' row)
from worker import sampler as after  # noqa: E402

VOCAB, ROWS, N = 49_152, 64, 8


def sampler_at(commit: str):
    source = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:worker/sampler.py"], check=True,
                            capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "sampler_before.py")
    with open(path, "w") as file:
        file.write(source)
    spec = importlib.util.spec_from_file_location("sampler_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sampler_before"] = module
    spec.loader.exec_module(module)
    return module


def workloads() -> dict[str, list[Row]]:
    rng = random.Random(0)
    outputs = [[rng.randrange(VOCAB) for _ in range(200)] for _ in range(N)]
    prompt = [rng.randrange(VOCAB) for _ in range(8_000)]
    words = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))] for _ in range(2_048)]
    cases = {
        "40,000 allowed_token_ids": [Row(SamplingParams(temperature=0.0, allowed_token_ids=rng.sample(range(VOCAB), 40_000)))],
        "40,000 logit_bias entries": [Row(SamplingParams(
            temperature=0.0, logit_bias={str(t): rng.uniform(-5, 5) for t in rng.sample(range(VOCAB), 40_000)}))],
        "repetition_penalty, 8,000-token prompt": [Row(SamplingParams(temperature=0.0, repetition_penalty=1.2),
                                                       prompt_token_ids=prompt)],
        "2,048 bad-word sequences": [Row(SamplingParams(temperature=0.0, bad_words=["x"]), bad_words_token_ids=words)],
        "none (64 plain greedy rows)": [Row(SamplingParams(temperature=0.0))],
    }
    built = {}
    for name, (template,) in cases.items():
        rows = [Row(template.params, template.prompt_token_ids, list(outputs[i]), None, template.bad_words_token_ids)
                for i in range(N)]
        built[name] = rows + [Row(SamplingParams(temperature=0.0)) for _ in range(ROWS - N)]
    return built


def per_step_ms(module, logits: torch.Tensor, rows: list[Row], steps: int = 10) -> float:
    sampler = module.Sampler(VOCAB, {2})
    sampler.sample(logits, rows).to_host()
    start = time.perf_counter()
    for _ in range(steps):
        sampler.sample(logits, rows).to_host()
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    torch.set_num_threads(1)
    before_commit = sys.argv[1] if len(sys.argv) > 1 else "fd6519b"
    before = sampler_at(before_commit)
    print(f"load average {os.getloadavg()[0]:.2f}; before = {before_commit}, after = this tree")
    logits = torch.randn(ROWS, VOCAB)
    for name, rows in workloads().items():
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(5):
            for label, module in (("before", before), ("after", after)):
                times[label].append(per_step_ms(module, logits, rows))
        line = "  ".join(f"{label} min {min(v):6.2f} median {sorted(v)[2]:6.2f}" for label, v in times.items())
        print(f"{name:42s} ms a step: {line}")


if __name__ == "__main__":
    main()
