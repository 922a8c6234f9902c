"""The engine core's overlapped steps and the front's output kinds, on a tiny checkpoint.

With `async_scheduling` the core launches step N+1 before it knows step N's tokens, so
a sequence that stops on a token at step N has one more position computed (its step-N+1
token, thrown away) and nothing else changes; a sequence that ends at its length limit
costs nothing extra, because its last token in flight is never scheduled past. DELTA
outputs carry only what is new (vLLM's RequestOutputKind.DELTA)."""

from __future__ import annotations

import pytest

from pagedq import LLM, SamplingParams
from pagedq.outputs import RequestOutputKind

PROMPT = {"prompt_token_ids": [21, 22, 23]}


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    return {overlap: LLM(model, dtype="float32", device="cpu", async_scheduling=overlap) for overlap in (False, True)}


def run(llm: LLM, params: SamplingParams):
    before = llm.llm_engine.stats()["tokens_computed"]
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    return out, llm.llm_engine.stats()["tokens_computed"] - before


def test_overlap_costs_one_discarded_token_after_a_stop_and_none_at_the_length_limit(engines):
    sync, overlap = engines[False], engines[True]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (by_length, sync_cost), (overlapped, overlap_cost) = run(sync, free), run(overlap, free)
    assert overlapped.token_ids == by_length.token_ids and overlapped.finish_reason == "length"
    assert overlap_cost == sync_cost == len(PROMPT["prompt_token_ids"]) + 12 - 1

    stop_token = by_length.token_ids[5]
    first = by_length.token_ids.index(stop_token)
    stopping = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token])
    (sync_out, sync_cost), (overlap_out, overlap_cost) = run(sync, stopping), run(overlap, stopping)
    assert sync_out.token_ids == overlap_out.token_ids == by_length.token_ids[: first + 1]
    assert (overlap_out.finish_reason, overlap_out.stop_reason) == ("stop", stop_token)
    assert overlap_cost == sync_cost + 1


def test_a_stop_string_ends_one_of_n_sequences_and_the_others_run_on(engines):
    for llm in engines.values():
        free = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0].outputs
        stop = free[1].text[2:4]
        assert len(stop) == 2 and stop not in free[1].text[:3]
        params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, stop=[stop])
        outputs = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
        for got, want in zip(outputs, free):
            if stop in want.text:
                assert got.finish_reason == "stop" and got.text == want.text[: want.text.index(stop)]
                assert got.token_ids == want.token_ids[: len(got.token_ids)]
            else:
                assert (got.token_ids, got.finish_reason) == (want.token_ids, "length")
        blocks = llm.llm_engine.block_manager
        assert blocks.num_free_blocks == blocks.num_total_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_delta_outputs_carry_only_what_is_new(engines, overlap):
    engine = engines[overlap].llm_engine
    params = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True, logprobs=1)
    engine.add_request("cumulative", PROMPT, params)
    engine.add_request("delta", PROMPT, params, output_kind=RequestOutputKind.DELTA)
    last: dict[int, object] = {}
    pieces: dict[int, list] = {0: [], 1: [], "text0": [], "text1": []}
    deltas = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == "cumulative":
                last = {c.index: c for c in output.outputs}
                continue
            deltas += 1
            for completion in output.outputs:
                pieces[completion.index] += completion.token_ids
                pieces[f"text{completion.index}"].append(completion.text)
                assert len(completion.logprobs) == len(completion.token_ids)
    assert deltas >= 10
    for index in (0, 1):
        assert pieces[index] == last[index].token_ids
        assert "".join(pieces[f"text{index}"]) == last[index].text


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_looked_at_every_so_often_gets_its_tokens_from_the_core_in_chunks(engines, overlap):
    """report_every_s (the service's worker asks it for a job nobody streams): the core sends
    the request's tokens in chunks instead of one a step. With 0 a chunk is due every step,
    so its outputs move on step by step exactly as a per-step request's; with an hour its
    only output is its last. Either way the outputs, text included, are the per-step ones."""
    engine = engines[overlap].llm_engine
    params = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True)
    engine.add_request("per-step", PROMPT, params)
    engine.add_request("every-step", PROMPT, params, report_every_s=0.0)
    engine.add_request("hourly", PROMPT, params, report_every_s=3600.0)
    seen: dict[str, list] = {"per-step": [], "every-step": [], "hourly": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(([(c.token_ids, c.text, c.finish_reason) for c in output.outputs],
                                            output.finished))
    assert len(seen["per-step"]) >= 10
    assert seen["every-step"] == seen["per-step"]
    assert seen["hourly"] == seen["per-step"][-1:]
    assert all(len(token_ids) == 10 for token_ids, _, _ in seen["hourly"][0][0])
