"""prompt_logprobs (vLLM's): per prompt token after the first, its logprob given the tokens
before it and the top alternatives, equal to transformers' log-softmax over the same
prompt, whatever chunked prefill, the prefix cache, preemption or a bystander's failing
forward do to the step that computes it."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedq import LLM, SamplingParams
from tests.test_engine_isolation import POISON, Poisoned, planned_requests


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def hf(model):
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def assert_matches_hf(hf, prompt: list[int], prompt_logprobs, k: int) -> None:
    expected = hf_logprobs(hf, prompt)
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    tol = 1e-4  # two engines' float sums differ in the last bits: near-ties may swap places
    for j in range(1, len(prompt)):
        entry = prompt_logprobs[j]
        row = expected[j - 1]
        own = entry[prompt[j]]
        assert own.logprob == pytest.approx(row[prompt[j]].item(), abs=tol)
        assert int((row > own.logprob + tol).sum()) + 1 <= own.rank <= int((row > own.logprob - tol).sum()) + 1
        top = sorted((e for e in entry.values() if e.rank <= k), key=lambda e: e.rank)
        assert [e.logprob for e in top] == pytest.approx(row.topk(k).values.tolist(), abs=tol)
        for token, logprob in entry.items():
            assert logprob.logprob == pytest.approx(row[token].item(), abs=tol)
        assert len(entry) in (k, k + 1)


def random_prompts(count: int, vocab: int) -> list[list[int]]:
    rng = random.Random()
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 90))] for _ in range(count)]


def test_prompt_logprobs_equal_hf_under_chunked_prefill_and_the_prefix_cache(model, hf, overlap):
    llm = LLM(model, dtype="float32", device="cpu", async_scheduling=overlap, max_num_batched_tokens=40,
              enable_prefix_caching=True, block_size=16)
    prompts = random_prompts(6, llm.llm_engine.vocab_size)
    # Run once without prompt logprobs so their blocks are cached: the second run must not read them.
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=2), use_tqdm=False)
    params = [SamplingParams(max_tokens=3, prompt_logprobs=k) for k in (0, 1, 5, 2, 0, 3)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, p, output in zip(prompts, params, outputs):
        assert_matches_hf(hf, prompt, output.prompt_logprobs, p.prompt_logprobs)
    plain = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_survive_preemption_mid_prefill(model, hf):
    """A cache too small for every prompt at once: prefills are preempted and recomputed;
    each position is reported once."""
    llm = LLM(model, dtype="float32", device="cpu", num_gpu_blocks_override=14, block_size=16, max_num_seqs=6,
              max_num_batched_tokens=48)
    prompts = [p + [5] * (80 - len(p)) for p in random_prompts(6, llm.llm_engine.vocab_size)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=1), use_tqdm=False)
    assert llm.llm_engine.scheduler.preemptions.recompute > 0
    for prompt, output in zip(prompts, outputs):
        assert_matches_hf(hf, prompt, output.prompt_logprobs, 1)


def test_a_bystanders_failing_forward_leaves_prompt_logprobs_intact(model, hf, monkeypatch):
    """The step's forward throws (the poison request's fault): each request runs again
    alone and its prompt positions' logits still come back in place."""
    llm = LLM(model, dtype="float32", device="cpu")
    engine = llm.llm_engine
    monkeypatch.setattr(engine.runner, "forward", Poisoned(engine.runner.forward, planned_requests))
    prompts = random_prompts(2, engine.vocab_size)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2, prompt_logprobs=2))
    engine.add_request("poison", {"prompt_token_ids": POISON}, SamplingParams(max_tokens=2))
    engine.add_request("b", {"prompt_token_ids": prompts[1]}, SamplingParams(max_tokens=2, prompt_logprobs=1))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["poison"].error is not None
    assert_matches_hf(hf, prompts[0], finished["a"].prompt_logprobs, 2)
    assert_matches_hf(hf, prompts[1], finished["b"].prompt_logprobs, 1)


def test_prompt_logprobs_from_a_core_in_its_own_process(model, hf):
    llm = LLM(model, dtype="float32", device="cpu", core_process=True)
    prompt = random_prompts(1, llm.llm_engine.vocab_size)[0]
    output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    assert_matches_hf(hf, prompt, output.prompt_logprobs, 3)
    assert output.prompt_logprobs[1][prompt[1]].decoded_token == llm.get_tokenizer().decode([prompt[1]])
