"""Beam search against a straightforward reference written here over Hugging Face logits."""

from __future__ import annotations

import pytest
import torch

from pagedq import LLM, BeamSearchParams, SamplingParams
from pagedq.beam_search import beam_score


def reference_beam_search(hf, prompt, params: BeamSearchParams, eos: set[int]):
    """(output ids, cum logprob) of the best hypotheses: every round each beam offers its
    2 * width likeliest tokens; EOS ends a hypothesis; the best `width` others live on."""
    beams, finished = [([], 0.0)], []
    for _ in range(params.max_tokens):
        candidates = []
        for output, cum in beams:
            with torch.no_grad():
                logprobs = hf(torch.tensor([prompt + output])).logits[0, -1].log_softmax(-1)
            values, ids = logprobs.topk(2 * params.beam_width)
            for value, token in zip(values.tolist(), ids.tolist()):
                if token in eos and not params.ignore_eos:
                    finished.append((output + [token], cum + value, True))
                else:
                    candidates.append((output + [token], cum + value))
        candidates.sort(key=lambda c: beam_score(len(prompt) + len(c[0]), c[1], False, params.length_penalty), reverse=True)
        beams = candidates[: params.beam_width]
    finished += [(output, cum, False) for output, cum in beams]
    finished.sort(key=lambda h: beam_score(len(prompt) + len(h[0]), h[1], h[2], params.length_penalty), reverse=True)
    return [(output, cum) for output, cum, _ in finished[: params.beam_width]]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


PROMPTS = [[5, 17, 42, 99, 3, 8], list(range(50, 90))]


def run(llm: LLM, params: BeamSearchParams, eos: set[int]):
    engine = llm.llm_engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = eos
    try:
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    finally:
        engine.eos_token_ids = saved
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks
    return outputs


def test_beam_width_one_is_greedy(model_dir, overlap):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", async_scheduling=overlap)
    greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0), use_tqdm=False)
    beams = run(llm, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True), set())
    for prompt, g, b in zip(PROMPTS, greedy, beams):
        (only,) = b.sequences
        assert only.tokens == prompt + g.outputs[0].token_ids
        assert only.cum_logprob == pytest.approx(g.outputs[0].cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("width,length_penalty,cache_blocks", [(3, 1.0, None), (4, 0.5, None), (3, 2.0, 6)])
def test_matches_reference_beam_search(model_dir, hf, width, length_penalty, cache_blocks, overlap):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", async_scheduling=overlap, num_gpu_blocks_override=cache_blocks)
    params = BeamSearchParams(beam_width=width, max_tokens=8, length_penalty=length_penalty)
    # An EOS that beams actually propose: the second likeliest first token of the first prompt.
    with torch.no_grad():
        eos = {hf(torch.tensor([PROMPTS[0]])).logits[0, -1].topk(2).indices[1].item()}
    outputs = run(llm, params, eos)
    finish_reasons = set()
    for prompt, output in zip(PROMPTS, outputs):
        want = reference_beam_search(hf, prompt, params, eos)
        assert [s.tokens[len(prompt):] for s in output.sequences] == [w[0] for w in want]
        assert [s.cum_logprob for s in output.sequences] == pytest.approx([w[1] for w in want], abs=1e-4)
        finish_reasons |= {s.finish_reason for s in output.sequences}
        assert all(isinstance(s.text, str) and s.text for s in output.sequences)
    assert "stop" in finish_reasons
    if cache_blocks:
        assert llm.llm_engine.stats()["num_preemptions_recompute"] > 0


def test_bad_beam_params_name_the_field():
    for kwargs, field in (({"beam_width": 0, "max_tokens": 4}, "beam_width"), ({"beam_width": 2, "max_tokens": 0}, "max_tokens")):
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**kwargs)
