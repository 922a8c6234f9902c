"""FP8 (e4m3) KV cache: twice the blocks of a bf16 cache in the same memory, and greedy
output close to the unquantized cache's. The agreement rates are printed (pytest -s)."""

from __future__ import annotations

import random

import pytest

from pagedq import LLM, SamplingParams

PROMPTS = 8
POSITIONS = 16


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def test_twice_the_blocks_of_bf16_in_the_same_memory(model_dir):
    budget = 1 << 20
    bf16 = LLM(str(model_dir), dtype="bfloat16", device="cpu", cpu_kv_cache_bytes=budget)
    fp8 = LLM(str(model_dir), dtype="bfloat16", device="cpu", cpu_kv_cache_bytes=budget, kv_cache_dtype="fp8")
    assert fp8.llm_engine.runner.num_blocks == 2 * bf16.llm_engine.runner.num_blocks
    assert fp8.llm_engine.runner.kv_cache.bytes_per_block * 2 == bf16.llm_engine.runner.kv_cache.bytes_per_block


def test_greedy_agreement_with_the_float32_cache(model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(5, 60))] for _ in range(PROMPTS)]
    greedy = SamplingParams(temperature=0, max_tokens=POSITIONS, ignore_eos=True)
    reference = LLM(str(model_dir), dtype="float32", device="cpu").generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    fp8 = LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_dtype="fp8")

    free_running = fp8.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    first_divergence = [
        next((i for i, (a, b) in enumerate(zip(r.outputs[0].token_ids, f.outputs[0].token_ids)) if a != b), POSITIONS)
        for r, f in zip(reference, free_running)
    ]
    # Teacher forcing: at each position the fp8 cache predicts the next token of the
    # float32 run from the same context, so one early difference does not count twice.
    contexts, expected = [], []
    for prompt, output in zip(prompts, reference):
        tokens = output.outputs[0].token_ids
        for i in range(POSITIONS):
            contexts.append({"prompt_token_ids": prompt + tokens[:i]})
            expected.append(tokens[i])
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    predicted = [o.outputs[0].token_ids[0] for o in fp8.generate(contexts, one_token, use_tqdm=False)]
    agreement = sum(p == e for p, e in zip(predicted, expected)) / len(expected)
    print(f"\nfp8 KV cache vs float32: next-token agreement {agreement:.1%} over {len(expected)} positions; "
          f"first divergence per prompt {first_divergence} (of {POSITIONS})")
    assert agreement >= 0.85
    assert sum(first_divergence) > 0
