"""The engine end to end on tiny random checkpoints: greedy float32 generation equals Hugging
Face `generate` token for token (also when the KV cache is so small that sequences are
preempted, and when the token budget is so small that prompts are prefilled in chunks),
every block comes back, and bad input is refused without disturbing other requests."""

from __future__ import annotations

import random

import pytest
import torch

from pagedq import LLM, SamplingParams
from pagedq.front.llm_engine import LLMEngine

MAX_TOKENS = 24
# Prompt lengths straddling block edges (block size 16) and chunk edges.
PROMPT_LENS = (1, 5, 16, 17, 33, 48)


def random_prompts(vocab_size: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lens]


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks, bm.owners()
    assert bm.num_swapped_blocks == 0


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llama(llama_dir, overlap):
    return LLM(str(llama_dir), dtype="float32", device="cpu", async_scheduling=overlap)


def test_greedy_equals_hf_generate(tiny_model_dir, tiny_arch, overlap):
    model_dir = tiny_model_dir(tiny_arch)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", async_scheduling=overlap)
    prompts = random_prompts(llm.llm_engine.vocab_size)
    assert generate_ids(llm, prompts, GREEDY) == hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert_all_blocks_free(llm.llm_engine)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_equals_hf_when_the_cache_forces_preemption(llama_dir, preemption_mode, overlap):
    # 7 blocks of 16 tokens hold two of these sequences at most: the rest must wait or be preempted.
    llm = LLM(
        str(llama_dir), dtype="float32", device="cpu", async_scheduling=overlap, num_gpu_blocks_override=7,
        preemption_mode=preemption_mode, swap_space=1e-3,
    )
    prompts = random_prompts(llm.llm_engine.vocab_size, lens=(40, 33, 20, 17, 45))
    assert generate_ids(llm, prompts, GREEDY) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    stats = llm.llm_engine.stats()
    assert stats[f"num_preemptions_{preemption_mode}"] > 0
    assert_all_blocks_free(llm.llm_engine)


def test_swap_falls_back_to_recompute_when_swap_space_is_full(llama_dir, overlap):
    # Swap space for one block only: most preemptions must recompute instead.
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", async_scheduling=overlap, num_gpu_blocks_override=7, preemption_mode="swap")
    engine = llm.llm_engine
    bytes_per_block = engine.runner.kv_cache.bytes_per_block
    llm = LLM(
        str(llama_dir), dtype="float32", device="cpu", async_scheduling=overlap, num_gpu_blocks_override=7, preemption_mode="swap",
        swap_space=bytes_per_block / (1 << 30),
    )
    prompts = random_prompts(llm.llm_engine.vocab_size, lens=(40, 33, 20, 17, 45))
    assert generate_ids(llm, prompts, GREEDY) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    assert llm.llm_engine.stats()["num_preemptions_recompute"] > 0
    assert_all_blocks_free(llm.llm_engine)


def test_greedy_equals_hf_with_chunked_prefill(llama_dir, overlap):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", async_scheduling=overlap, max_num_batched_tokens=7)
    prompts = random_prompts(llm.llm_engine.vocab_size)
    assert generate_ids(llm, prompts, GREEDY) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    # Each step computed at most 7 tokens, so the prompts needed many steps to prefill.
    stats = llm.llm_engine.stats()
    assert stats["steps"] >= sum(PROMPT_LENS) // 7
    assert stats["tokens_computed"] <= 7 * stats["steps"]


def test_prefix_caching_changes_nothing_but_the_work(llama_dir, overlap):
    shared = random_prompts(512, lens=(40,), seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(512, lens=(1, 5, 9, 20), seed=4)]
    outputs = {}
    for caching in (False, True):
        llm = LLM(str(llama_dir), dtype="float32", device="cpu", async_scheduling=overlap, enable_prefix_caching=caching)
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)  # fills the cache
        before = llm.llm_engine.stats()["prompt_tokens_computed"]
        outputs[caching] = generate_ids(llm, prompts, GREEDY)
        computed = llm.llm_engine.stats()["prompt_tokens_computed"] - before
        if caching:
            # The shared 40 tokens hold two full blocks (32 tokens), each cached once.
            assert computed == sum(len(p) for p in prompts) - 32 * len(prompts)
        else:
            assert computed == sum(len(p) for p in prompts)
    assert outputs[True] == outputs[False]


def test_fully_cached_prompt_still_gets_its_first_token(llama):
    prompt = random_prompts(512, lens=(32,), seed=5)[0]  # exactly two blocks
    first = generate_ids(llama, [prompt], GREEDY)
    hits_before = llama.llm_engine.stats()["prefix_cache_hits"]
    assert generate_ids(llama, [prompt], GREEDY) == first
    # Everything but the last token came from the cache; that one is recomputed for its logits.
    assert llama.llm_engine.stats()["prefix_cache_hits"] - hits_before == 31
    assert_all_blocks_free(llama.llm_engine)


def test_blocks_come_back_after_abort(llama):
    engine = llama.llm_engine
    params = SamplingParams(temperature=0.8, max_tokens=50, ignore_eos=True, seed=1)
    for i, prompt in enumerate(random_prompts(engine.vocab_size, seed=6)):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_total_blocks
    engine.abort_request(["abort-0", "abort-3", "unknown-id"])
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert {finished[r].outputs[0].finish_reason for r in ("abort-0", "abort-3")} == {"abort"}
    engine.add_request("abort-0", {"prompt_token_ids": [5]}, params)  # free again once its abort was returned
    engine.abort_request("abort-0")
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("abort-0", {"prompt_token_ids": [5]}, params)
    assert [o.request_id for o in engine.step()] == ["abort-0"]
    assert {finished[f"abort-{i}"].outputs[0].finish_reason for i in (1, 2, 4, 5)} == {"length"}
    assert_all_blocks_free(engine)


BAD_INPUT = [
    ("", SamplingParams(), "prompt"),
    ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
    ({"prompt_token_ids": [1] * 1024}, SamplingParams(), "max_model_len"),
    ({"prompt_token_ids": [1, 512]}, SamplingParams(), "prompt_token_ids"),
    ({"prompt_token_ids": [1, -1]}, SamplingParams(), "prompt_token_ids"),
    ({"prompt_token_ids": "abc"}, SamplingParams(), "prompt_token_ids"),
    ({"text": "hi"}, SamplingParams(), "prompt"),
    (42, SamplingParams(), "prompt"),
    ("hello", {"temperature": 0.5}, "params"),
    ({"prompt_token_ids": [5]}, SamplingParams(stop_token_ids=[9999]), "stop_token_ids"),
]


@pytest.mark.parametrize("prompt,params,field", BAD_INPUT)
def test_bad_requests_raise_value_error_naming_the_field(llama, prompt, params, field):
    engine = llama.llm_engine
    engine.add_request("innocent", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["innocent"]
    assert len(outputs[0].outputs[0].token_ids) == MAX_TOKENS


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [1]}, "stop"),
        ({"stop": 7}, "stop"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_sampling_params_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_generate_with_a_bad_prompt_queues_nothing(llama):
    with pytest.raises(ValueError, match="prompt"):
        llama.generate(["fine", ""], GREEDY, use_tqdm=False)
    assert not llama.llm_engine.has_unfinished_requests()
    assert_all_blocks_free(llama.llm_engine)


def test_seeded_request_is_the_same_alone_and_in_a_batch_of_32(llama):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    prompt = {"prompt_token_ids": [10, 20, 30, 40]}
    alone = llama.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in random_prompts(512, lens=[3 + i for i in range(31)], seed=7)]
    params = [SamplingParams(temperature=0.7 + 0.01 * i, max_tokens=5 + i, ignore_eos=True) for i in range(31)]
    batch = llama.generate(others[:13] + [prompt] + others[13:], params[:13] + [seeded] + params[13:], use_tqdm=False)
    assert batch[13].outputs[0].token_ids == alone
    # An unseeded request is not tied to that stream.
    unseeded = seeded.model_copy(update={"seed": None})
    draws = {tuple(llama.generate([prompt], unseeded, use_tqdm=False)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(draws) > 1


def test_stop_string_cuts_the_text_and_names_itself(llama):
    prompt = "the quick brown fox"
    free = llama.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    stop = free.text[10:13]
    assert len(stop) == 3 and stop in free.text
    cut = free.text[: free.text.index(stop)]
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=30, stop=[stop, "\u2603never"], include_stop_str_in_output=include)
        out = llama.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (cut + stop if include else cut)
        assert out.token_ids == free.token_ids[: len(out.token_ids)]


def test_stop_token_ids_max_tokens_and_eos(llama):
    prompt = {"prompt_token_ids": [11, 12, 13]}
    free = llama.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    tokens = free.outputs[0].token_ids
    assert free.outputs[0].finish_reason == "length" and len(tokens) == 20
    stop_token = tokens[6]
    out = llama.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token]), use_tqdm=False)[0]
    first = tokens.index(stop_token)
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_token)
    # min_tokens holds the stop token back until enough tokens exist.
    held = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token], min_tokens=first + 2)
    out = llama.generate([prompt], held, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > first + 1 and stop_token not in out.token_ids[: first + 2]


def test_stop_token_text_follows_vllm_v1(llama):
    """vLLM V1: the text of the eos / stop_token_ids token that ends a sequence is left
    out unless include_stop_str_in_output; the length limit is checked first, so a stop
    token that is also the max_tokens-th token ends with "length" and keeps its text."""
    tokenizer = llama.get_tokenizer()
    prompt = {"prompt_token_ids": [11, 12, 13]}
    tokens = llama.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stop_token = tokens[6]
    first = tokens.index(stop_token)
    before, with_stop = tokenizer.decode(tokens[:first]), tokenizer.decode(tokens[: first + 1])
    assert with_stop != before
    for include, text in ((False, before), (True, with_stop)):
        params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token], include_stop_str_in_output=include)
        out = llama.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (out.text, out.token_ids, out.finish_reason) == (text, tokens[: first + 1], "stop")
    capped = SamplingParams(temperature=0, max_tokens=first + 1, stop_token_ids=[stop_token])
    out = llama.generate([prompt], capped, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (with_stop, "length", None)


def test_eos_ends_generation_unless_ignored(llama):
    engine = llama.llm_engine
    # Make the tokenizer's eos one of the tokens greedy decoding is known to produce.
    prompt = {"prompt_token_ids": [21, 22, 23]}
    tokens = llama.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    saved = engine.eos_token_ids
    engine.eos_token_ids = {tokens[4]}
    try:
        out = llama.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0].outputs[0]
        ignored = llama.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    finally:
        engine.eos_token_ids = saved
    first = tokens.index(tokens[4])
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop" and out.stop_reason is None
    # vLLM V1 leaves the eos token's text out (it would show with skip_special_tokens=False).
    assert out.text == llama.get_tokenizer().decode(tokens[:first]) != llama.get_tokenizer().decode(tokens[: first + 1])
    assert ignored.token_ids == tokens


def test_logprobs_and_cumulative_logprob(llama_dir, llama):
    from transformers import AutoModelForCausalLM

    prompt = [31, 32, 33, 34]
    out = llama.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    completion = out.outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1]
    expected = logits.log_softmax(-1)
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert token in entry and len(entry) == 3  # greedy: the sampled token is the top one
        assert entry[token].rank == 1
        top = expected[step].topk(3)
        assert list(entry) == top.indices.tolist()
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(expected[step, token_id].item(), abs=1e-4)
            assert isinstance(logprob.decoded_token, str)
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_cumulative_logprob_only_with_logprobs_as_in_vllm_v1(llama):
    """vLLM V1 reports cumulative_logprob only for requests that ask for logprobs (None
    otherwise); logprobs=0 asks for the sampled token's alone. Rows of both kinds share
    one batch, and the logprobs of a row that asked do not depend on its neighbours."""
    prompts = [{"prompt_token_ids": [31, 32, 33, 34]}, {"prompt_token_ids": [40, 41]}]
    plain = SamplingParams(temperature=0, max_tokens=4)
    with_logprobs = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
    mixed = llama.generate(prompts, [plain, with_logprobs], use_tqdm=False)
    assert mixed[0].outputs[0].cumulative_logprob is None and mixed[0].outputs[0].logprobs is None
    alone = llama.generate(prompts[1:], with_logprobs, use_tqdm=False)[0].outputs[0]
    completion = mixed[1].outputs[0]
    assert [list(entry) for entry in completion.logprobs] == [[t] for t in completion.token_ids]
    assert completion.cumulative_logprob == pytest.approx(alone.cumulative_logprob, abs=1e-5) and alone.cumulative_logprob < 0


def test_metrics_are_ordered(llama):
    out = llama.generate(["hello there"], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert out.prompt == "hello there" and out.prompt_token_ids and out.finished


def test_priority_runs_first_with_one_slot(llama_dir, overlap):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", async_scheduling=overlap, max_num_seqs=1)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid, priority in (("low-1", 5), ("low-2", 5), ("urgent", -1), ("mid", 0)):
        engine.add_request(rid, {"prompt_token_ids": [7, 8, 9]}, params, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["urgent", "mid", "low-1", "low-2"]


def test_parallel_sampling_shares_the_prompt(llama_dir, overlap):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", async_scheduling=overlap)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": random_prompts(512, lens=(70,), seed=8)[0]}

    def peak_blocks(prompts, params) -> int:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"peak-{i}-{id(sp)}", p, sp)
        peak, outputs = 0, []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
            peak = max(peak, engine.block_manager.num_total_blocks - engine.block_manager.num_free_blocks)
        assert_all_blocks_free(engine)
        engine.block_manager.gpu = type(engine.block_manager.gpu)(engine.block_manager.num_total_blocks)  # drop the prefix cache
        return peak, outputs

    sample = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=99, ignore_eos=True)
    computed_before = engine.stats()["prompt_tokens_computed"]
    shared_peak, (out,) = peak_blocks([prompt], [sample])
    assert engine.stats()["prompt_tokens_computed"] - computed_before == 70  # the prompt, once
    single = sample.model_copy(update={"n": 1})
    separate_peak, separate = peak_blocks([prompt] * 4, [single.model_copy(update={"seed": 99 + i}) for i in range(4)])
    assert shared_peak < separate_peak
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    # Output i draws from seed + i: forking (and copying shared blocks on write) changes nothing.
    by_seed = {o.request_id: o.outputs[0].token_ids for o in separate}
    assert [c.token_ids for c in out.outputs] == [by_seed[o] for o in sorted(by_seed, key=lambda r: int(r.split("-")[1]))]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_skip_tokenizer_init_takes_token_ids_only(llama_dir, overlap):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", async_scheduling=overlap, skip_tokenizer_init=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text"], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="stop"):
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(stop=["x"]), use_tqdm=False)


def test_output_kinds(llama):
    from pagedq.outputs import RequestOutputKind

    engine = llama.llm_engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("every-step", {"prompt_token_ids": [4, 5, 6]}, params)
    engine.add_request("final", {"prompt_token_ids": [4, 5, 6]}, params, output_kind=RequestOutputKind.FINAL_ONLY)
    seen: dict[str, list[int]] = {"every-step": [], "final": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(len(output.outputs[0].token_ids))
    assert seen == {"every-step": [1, 2, 3, 4, 5], "final": [5]}


def test_deferred_outputs_are_built_when_asked_and_agree_with_every_steps(llama):
    """step(defer_outputs=True) returns only finished requests; deferred_outputs() then gives
    each running request that moved on one output, with everything up to now (CUMULATIVE) or
    everything new since its last one (DELTA), the same text as outputs built every step."""
    from pagedq.outputs import RequestOutputKind

    engine = llama.llm_engine
    prompt = {"prompt_token_ids": [4, 5, 6, 7]}
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    engine.add_request("reference", prompt, params)
    reference = []
    while engine.has_unfinished_requests():
        reference += [output.outputs[0] for output in engine.step()]
    engine.add_request("cumulative", prompt, params)
    engine.add_request("delta", prompt, params, output_kind=RequestOutputKind.DELTA)
    seen: dict[str, list] = {"cumulative": [], "delta": []}
    finished = []
    step = 0
    while engine.has_unfinished_requests():
        outputs = engine.step(defer_outputs=True)
        assert all(output.finished for output in outputs)
        finished += [output.request_id for output in outputs]
        step += 1
        if step % 3 == 0:  # a look every third step
            for output in engine.deferred_outputs():
                seen[output.request_id].append(output.outputs[0])
        for output in outputs:
            seen[output.request_id].append(output.outputs[0])
    assert sorted(finished) == ["cumulative", "delta"] and engine.deferred_outputs() == []
    # One output a look (3 steps: 3 tokens, or 2 for the first look of an overlapped engine,
    # whose steps return a step late), the last with the finish.
    lengths = [len(c.token_ids) for c in seen["cumulative"]]
    assert lengths[-1] == 9 and len(lengths) <= 4 and lengths == sorted(set(lengths))
    assert seen["cumulative"][-1].text == reference[-1].text and seen["cumulative"][-1].token_ids == reference[-1].token_ids
    # The two ran in lockstep: each delta holds what the cumulative output grew by.
    assert [len(c.token_ids) for c in seen["delta"]] == [b - a for a, b in zip([0] + lengths, lengths)]
    assert "".join(c.text for c in seen["delta"]) == reference[-1].text
    assert [t for c in seen["delta"] for t in c.token_ids] == reference[-1].token_ids


def test_deferred_outputs_not_wanted_wait_for_a_later_look(llama):
    """deferred_outputs(wanted) builds only the wanted requests' outputs (the worker: those
    whose delta is due); the others stay deferred and come later with everything since."""
    from pagedq.outputs import RequestOutputKind

    engine = llama.llm_engine
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    for request_id in ("often", "rarely"):
        engine.add_request(request_id, {"prompt_token_ids": [4, 5, 6, 7]}, params, output_kind=RequestOutputKind.DELTA)
    seen: dict[str, list] = {"often": [], "rarely": []}
    looks = 0
    while engine.has_unfinished_requests():
        outputs = engine.step(defer_outputs=True)
        looks += 1
        outputs += engine.deferred_outputs(lambda request_id: request_id == "often" or looks % 4 == 0)
        for output in outputs:
            seen[output.request_id].append(output.outputs[0])
    # Greedy, one prompt: the same tokens and text, in fewer, larger deltas for "rarely".
    assert len(seen["rarely"]) <= 4 < len(seen["often"])
    for request_id in ("often", "rarely"):
        assert sum(len(c.token_ids) for c in seen[request_id]) == 9
        assert seen[request_id][-1].finish_reason == "length"
    assert "".join(c.text for c in seen["rarely"]) == "".join(c.text for c in seen["often"])
    assert engine.deferred_outputs() == []


def test_compiling_served_shapes_at_start_leaves_no_trace(llama_dir):
    """ModelRunner.compile_served_shapes, which a CUDA engine runs at start so that Triton
    compiles every served batch shape's kernels before the first request: each of its
    batches is a valid step (run here on the CPU kernels), and its garbage, written in the
    real cache's blocks, changes nothing of what the engine computes after."""
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=64)
    runner = llm.llm_engine.engine_core.runner
    runner.compile_served_shapes()
    prompts = random_prompts(llm.llm_engine.vocab_size)
    assert generate_ids(llm, prompts, GREEDY) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    assert_all_blocks_free(llm.llm_engine)
