"""The engine end to end on a CUDA device: Triton attention and KV stores compiled for the
GPU, decode replayed from CUDA graphs, greedy float32 generation equal to transformers'
on the same device token for token, with overlapped steps (CUDA's default: each step's
inputs read the previous step's sampled ids on the device) and without. These run only
where a GPU is present (never in CI, which has none); test_engine.py holds the same
contracts on the CPU."""

from __future__ import annotations

import pytest
import torch

from pagedq import LLM, SamplingParams
from tests.test_engine import MAX_TOKENS, PROMPT_LENS, assert_all_blocks_free, generate_ids, random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def hf_greedy_cuda(model_dir, prompts: list[list[int]], max_new_tokens: int, dtype=torch.float32) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt], device="cuda"), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(autouse=True)
def no_tf32():
    # float32 equality needs float32 matmuls: TF32 would round every product to 10 mantissa bits.
    assert not torch.backends.cuda.matmul.allow_tf32


def cuda_llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cuda", **kwargs)


def test_greedy_equals_hf_on_cuda_with_graphs(tiny_model_dir, tiny_arch, overlap):
    model_dir = tiny_model_dir(tiny_arch)
    llm = cuda_llm(model_dir, async_scheduling=overlap)
    engine = llm.llm_engine
    assert engine.runner.attention.name == "triton"
    prompts = random_prompts(engine.vocab_size)
    assert generate_ids(llm, prompts, GREEDY) == hf_greedy_cuda(model_dir, prompts, MAX_TOKENS)
    assert engine.runner.graphs is not None
    assert_all_blocks_free(engine)


def test_eager_and_graph_decode_agree(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    llm = cuda_llm(model_dir)
    prompts = random_prompts(llm.llm_engine.vocab_size, lens=tuple(range(1, 40, 3)))
    graphs = generate_ids(llm, prompts, GREEDY)
    eager = generate_ids(cuda_llm(model_dir, enforce_eager=True), prompts, GREEDY)
    assert graphs == eager


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_on_cuda(tiny_model_dir, preemption_mode, overlap):
    model_dir = tiny_model_dir("llama")
    llm = cuda_llm(model_dir, num_gpu_blocks_override=7, preemption_mode=preemption_mode, swap_space=1e-3,
                   async_scheduling=overlap)
    prompts = random_prompts(llm.llm_engine.vocab_size, lens=(40, 33, 20, 17, 45))
    assert generate_ids(llm, prompts, GREEDY) == hf_greedy_cuda(model_dir, prompts, MAX_TOKENS)
    assert llm.llm_engine.stats()[f"num_preemptions_{preemption_mode}"] > 0
    assert_all_blocks_free(llm.llm_engine)


def test_chunked_prefill_and_prefix_caching_on_cuda(tiny_model_dir, overlap):
    model_dir = tiny_model_dir("llama")
    llm = cuda_llm(model_dir, max_num_batched_tokens=7, async_scheduling=overlap)
    vocab = llm.llm_engine.vocab_size
    shared = random_prompts(vocab, lens=(35,), seed=5)[0]
    prompts = random_prompts(vocab) + [shared + p for p in random_prompts(vocab, lens=(3, 9), seed=6)]
    want = hf_greedy_cuda(model_dir, prompts, MAX_TOKENS)
    assert generate_ids(llm, prompts, GREEDY) == want
    # Again: the shared prefix and the whole prompts now come from the prefix cache.
    assert generate_ids(llm, prompts, GREEDY) == want
    assert llm.llm_engine.stats()["prefix_cache_hits"] > 0
    assert_all_blocks_free(llm.llm_engine)


def test_bfloat16_mostly_agrees_with_transformers_bfloat16(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda")
    prompts = random_prompts(llm.llm_engine.vocab_size, lens=PROMPT_LENS)
    ours = generate_ids(llm, prompts, GREEDY)
    theirs = hf_greedy_cuda(model_dir, prompts, MAX_TOKENS, dtype=torch.bfloat16)
    # bf16 rounding differs between kernels, so greedy paths may part after a near tie; the
    # first token of every prompt comes from one forward and must agree.
    assert [o[0] for o in ours] == [t[0] for t in theirs]
    agreeing = sum(a == b for o, t in zip(ours, theirs) for a, b in zip(o, t))
    print(f"bf16 tokens equal to transformers' bf16: {agreeing}/{len(prompts) * MAX_TOKENS}")


def test_overlapped_sampling_on_cuda_matches_steps_one_at_a_time(tiny_model_dir):
    """Seeded parallel sampling (n > 1 branching at the prompt's last chunk), logprobs and
    a stop token under overlap give what synchronous steps give."""
    model_dir = tiny_model_dir("llama")
    params = [
        SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, stop_token_ids=[7, 9, 11]),
    ]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(512, lens=(5, 17, 33))]

    def run(overlap: bool):
        outputs = cuda_llm(model_dir, async_scheduling=overlap).generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.finish_reason, [sorted(e) for e in c.logprobs or []]) for c in o.outputs] for o in outputs]

    assert run(True) == run(False)


def test_inputs_prepared_faster_than_the_device_reads_them_stay_intact():
    """InputBatch refills a pinned staging buffer only once the device has read its last
    copy: ModelRunner.compile_served_shapes prepares forwards back to back without reading
    anything back, and an overwritten buffer had fed one forward another's token ids,
    positions and slots (out-of-range indices: a device-side assert, CUBLAS failures at a
    fresh engine's start on an H200). The device is held busy so that every copy is still
    queued when the next plans are written."""
    from worker.input_batch import InputBatch, StepPlan

    batch = InputBatch(max_blocks_per_seq=8, block_size=16, device=torch.device("cuda"), vocab_size=1000, initial_rows=4)

    def plan(first_token: int, query_len: int) -> StepPlan:
        return StepPlan(rows=[0], starts=[0], query_lens=[query_len], token_ids=list(range(first_token, first_token + query_len)),
                        pending_at=[], pending_from=[], logits_of=[0], changed_rows=[(0, [3, 5])], owners=[None])

    torch.cuda._sleep(200_000_000)  # ~0.1 s of the stream's time before any copy runs
    prepared = [(first, batch.prepare(plan(first, 5 + first % 7), None)) for first in (100, 200, 300, 400, 500)]
    torch.cuda.synchronize()
    for first, inputs in prepared:
        query_len = 5 + first % 7
        assert inputs.input_ids.tolist() == list(range(first, first + query_len))
        assert inputs.positions.tolist() == list(range(query_len))
        assert inputs.metadata.slot_mapping.tolist() == [3 * 16 + p for p in range(query_len)]
        assert inputs.metadata.seq_lens.tolist() == [query_len]
