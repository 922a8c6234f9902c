"""A mixed workload on a cache far too small for it: greedy, seeded sampling, parallel
sampling and beam search requests arriving over time, some aborted, with preemption by
recompute and by swap. Every request that was not aborted must produce exactly what it
produces alone on an unconstrained engine, and every block must come back."""

from __future__ import annotations

import random

import pytest

from pagedq import LLM, BeamSearchParams, SamplingParams
from pagedq.outputs import RequestOutputKind


def make_requests(seed: int):
    rng = random.Random(seed)
    requests = []
    for i in range(24):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randint(1, 60))]
        kind = rng.choice(["greedy", "sampled", "parallel", "beam"])
        if kind == "greedy":
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True)
        elif kind == "sampled":
            params = SamplingParams(temperature=0.9, top_k=50, seed=rng.randrange(1000), max_tokens=rng.randint(1, 30), ignore_eos=True)
        elif kind == "parallel":
            params = SamplingParams(n=3, temperature=1.0, seed=rng.randrange(1000), max_tokens=rng.randint(1, 20), ignore_eos=True)
        else:
            params = BeamSearchParams(beam_width=rng.randint(1, 3), max_tokens=rng.randint(1, 8), ignore_eos=True)
        requests.append((f"r{i}", prompt, params, rng.randint(-1, 1)))
    return requests


def outcome(output):
    return [(c.token_ids, c.finish_reason) for c in output.outputs]


@pytest.fixture(scope="module")
def alone(tiny_model_dir):
    """Each request's output when it runs by itself with all the memory it wants."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu")
    results = {}
    for rid, prompt, params, _ in make_requests(0):
        runner = llm.beam_search if isinstance(params, BeamSearchParams) else None
        if runner is None:
            results[rid] = outcome(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0])
        else:
            engine = llm.llm_engine
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[rid] = outcome(out)
    return results


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_mixed_workload_under_memory_pressure(tiny_model_dir, alone, preemption_mode, overlap):
    llm = LLM(
        str(tiny_model_dir("llama")), dtype="float32", device="cpu", async_scheduling=overlap, num_gpu_blocks_override=10,
        max_num_batched_tokens=48, max_num_seqs=12, preemption_mode=preemption_mode, swap_space=4e-4,
    )
    engine = llm.llm_engine
    pending = make_requests(0)
    rng = random.Random(1)
    added, aborted, results, steps = set(), set(), {}, 0
    while pending or engine.has_unfinished_requests():
        # Requests arrive a few at a time while others run; now and then one is aborted.
        for _ in range(min(len(pending), rng.randint(0, 3))):
            rid, prompt, params, priority = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params, priority=priority,
                               output_kind=RequestOutputKind.FINAL_ONLY)
            added.add(rid)
        live = sorted(added - set(results) - aborted)
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            engine.abort_request(victim)
            aborted.add(victim)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output
        engine.block_manager.check_invariants()
        steps += 1
        assert steps < 5000, "the engine stopped making progress"
    stats = engine.stats()
    assert stats[f"num_preemptions_{preemption_mode}"] > 0
    assert len(results) == 24 and aborted
    for rid, output in results.items():
        if rid in aborted:
            assert all(c.finish_reason == "abort" for c in output.outputs) or output.outputs == []
        else:
            assert outcome(output) == alone[rid], rid
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_swapped_blocks == 0
