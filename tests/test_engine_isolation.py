"""One request can only fail itself (issue 16): whatever a request causes to throw inside
a step (its forward, sampling, detokenization) fails that request alone, with its output
finished and `error` set; the step's other requests go on to the tokens they would have
produced alone, and every KV block comes back. Offline, `LLM.generate` then raises
RequestFailed and the engine is empty for the next call, never hung.

Nothing that passes `add_request` is known to throw any more (the issue's poison requests
are refused up front, see the last tests), so the faults are injected: the real engine and
model, with one component wrapped to throw whenever the poison request's rows are in it.
"""

from __future__ import annotations

import pytest
import torch

from pagedq import LLM, BeamSearchParams, SamplingParams
from pagedq.front.llm import RequestFailed

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=7)
BYSTANDERS = [[5, 6, 7], [9, 10, 11, 12], [300, 301], [40] * 20, [77, 78, 79], [100, 200, 300, 400, 500]]


@pytest.fixture(scope="module")
def llm(tiny_model_dir, overlap):
    return LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", async_scheduling=overlap, max_num_seqs=8)


@pytest.fixture(scope="module")
def alone(llm):
    """Each bystander's tokens when it runs on its own (greedy, and one seeded sample)."""
    greedy = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in BYSTANDERS], GREEDY, use_tqdm=False)]
    seeded = llm.generate({"prompt_token_ids": BYSTANDERS[0]}, SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    return greedy, seeded


POISON = [11, 12, 13]


def is_poison(request) -> bool:
    return request.prompt_token_ids == POISON


class Poisoned:
    """Wraps a callable of the engine so that it throws whenever the poison request is among those in its input."""

    def __init__(self, inner, requests_of):
        self.inner, self.requests_of = inner, requests_of
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        if any(is_poison(request) for request in self.requests_of(*args)):
            raise RuntimeError("poison")
        return self.inner(*args)


def sampled_requests(logits, rows):
    return [seq.request for seq in rows]


def planned_requests(plan):
    """The requests of a forward's StepPlan."""
    return [seq.request for seq in plan.owners]


def run_with_poison(llm, poison_params=GREEDY):
    """Bystanders (greedy, plus one seeded) and a poison request among them in one engine
    (rows on both sides of its own); every final output by id."""
    engine = llm.llm_engine
    for i, prompt in enumerate(BYSTANDERS):
        engine.add_request(f"ok-{i}", {"prompt_token_ids": prompt}, GREEDY)
        if i == 2:
            engine.add_request("poison", {"prompt_token_ids": POISON}, poison_params)
    engine.add_request("seeded", {"prompt_token_ids": BYSTANDERS[0]}, SEEDED)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def assert_only_the_poison_failed(llm, finished, alone, what: str):
    greedy, seeded = alone
    poison = finished.pop("poison")
    assert poison.error is not None and what in poison.error
    assert {c.finish_reason for c in poison.outputs} == {"error"}
    assert [finished[f"ok-{i}"].outputs[0].token_ids for i in range(len(BYSTANDERS))] == greedy
    assert finished["seeded"].outputs[0].token_ids == seeded
    assert all(o.error is None for o in finished.values())
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks


def test_a_sampling_fault_fails_only_its_request(llm, alone, monkeypatch):
    engine = llm.llm_engine
    poisoned = Poisoned(engine.runner.sample, sampled_requests)
    monkeypatch.setattr(engine.runner, "sample", poisoned)
    finished = run_with_poison(llm, SamplingParams(temperature=0.0, max_tokens=8, n=2))
    assert_only_the_poison_failed(llm, finished, alone, "sampling failed")
    assert poisoned.calls > 1  # the batched call threw, then each request was sampled alone


def test_a_forward_fault_fails_only_its_request(llm, alone, monkeypatch):
    engine = llm.llm_engine
    poisoned = Poisoned(engine.runner.forward, planned_requests)
    monkeypatch.setattr(engine.runner, "forward", poisoned)
    finished = run_with_poison(llm)
    assert_only_the_poison_failed(llm, finished, alone, "forward pass failed")


def test_a_detokenizer_fault_fails_only_its_request(llm, alone, monkeypatch):
    from pagedq.front import output_processor

    class Exploding:
        def update(self, token_ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poison")

    real = output_processor.IncrementalDetokenizer

    def detokenizer(tokenizer, prompt_token_ids, params):
        return Exploding() if prompt_token_ids == POISON else real(tokenizer, prompt_token_ids, params)

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", detokenizer)
    finished = run_with_poison(llm)
    assert_only_the_poison_failed(llm, finished, alone, "processing its new token failed")


def test_a_token_outside_the_vocabulary_fails_only_its_request(llm, alone, monkeypatch):
    engine = llm.llm_engine
    sample = engine.runner.sample

    def out_of_vocab(logits, rows):
        out = sample(logits, rows)
        poison = [i for i, seq in enumerate(rows) if is_poison(seq.request)]
        if poison:
            with torch.inference_mode():  # the sampler's tensors are inference tensors
                out.token_ids[poison] = engine.vocab_size
        return out

    monkeypatch.setattr(engine.runner, "sample", out_of_vocab)
    assert_only_the_poison_failed(llm, run_with_poison(llm), alone, "outside the vocabulary")


def test_a_beam_search_fault_fails_only_its_request(llm, alone, monkeypatch):
    from pagedq.beam_search import BeamSearch

    def report(self, *args):
        raise RuntimeError("poison")

    monkeypatch.setattr(BeamSearch, "report", report)
    finished = run_with_poison(llm, BeamSearchParams(beam_width=2, max_tokens=4))
    assert_only_the_poison_failed(llm, finished, alone, "advancing its beams failed")


def test_generate_raises_for_the_failed_prompt_and_the_next_call_runs(llm, alone, monkeypatch):
    engine = llm.llm_engine
    monkeypatch.setattr(engine.runner, "sample", Poisoned(engine.runner.sample, sampled_requests))
    with pytest.raises(RequestFailed, match="prompt 1 failed: sampling failed") as failed:
        llm.generate([{"prompt_token_ids": BYSTANDERS[0]}, {"prompt_token_ids": POISON}], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert failed.value.outputs[0].outputs[0].token_ids == alone[0][0]
    assert not engine.has_unfinished_requests()
    assert llm.generate({"prompt_token_ids": BYSTANDERS[1]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == alone[0][1]


def test_a_step_that_raises_leaves_generate_callable(llm, alone, monkeypatch):
    """The issue's hang: a step raised inside generate, the request stayed in the engine and the next call never returned."""
    engine = llm.llm_engine

    def broken(plan):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "forward", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate([{"prompt_token_ids": p} for p in BYSTANDERS[:2]], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert llm.generate({"prompt_token_ids": BYSTANDERS[2]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == alone[0][2]


# ---- the poison requests, offline --------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"n": 2, "seed": 18446744073709551615}, "seed"),  # seed + index overflowed the generator
        ({"seed": -(2**63) - 1}, "seed"),
        ({"temperature": float("inf"), "min_tokens": 3, "max_tokens": 6}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"stop": ["a\ud800b"]}, "stop"),
    ],
)
def test_poison_sampling_params_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_the_largest_seeds_run(llm):
    for seed in (2**63 - 1, -(2**63)):
        outputs = llm.generate("hi", SamplingParams(n=3, seed=seed, max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs
        assert [len(o.token_ids) for o in outputs] == [4, 4, 4]


def test_a_denormal_top_p_keeps_the_most_likely_token(llm):
    """top_p=5e-324 is 0 in float32, which removed every token (the sampler then drew id == vocab size)."""
    tiny = llm.generate("hi", SamplingParams(top_p=5e-324, max_tokens=4, seed=1), use_tqdm=False)[0].outputs[0]
    greedy = llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert tiny.token_ids == greedy.token_ids


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ("hi", SamplingParams(n=9, max_tokens=4), "n"),  # more than max_num_seqs=8: never schedulable
        ("hi", BeamSearchParams(beam_width=9, max_tokens=4), "beam_width"),
        ("a\ud800b", SamplingParams(), "prompt"),
    ],
)
def test_requests_no_engine_can_run_are_refused(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.llm_engine.add_request("refused", prompt, params)
    assert not llm.llm_engine.has_unfinished_requests()


def test_n_equal_to_max_num_seqs_runs(llm):
    outputs = llm.generate("hi", SamplingParams(n=8, max_tokens=3, seed=3, ignore_eos=True), use_tqdm=False)[0].outputs
    assert len(outputs) == 8 and all(len(o.token_ids) == 3 for o in outputs)


def test_a_request_past_its_share_is_refused_and_one_within_it_leaves_room_for_others(tiny_model_dir):
    """With max_seqs_per_request (a service's engine sets half of max_num_seqs), a wide
    request is refused before it can take every slot; one at the limit runs beside a chat
    sent after it, which ends long before the wide one. vLLM bounds n by max_num_seqs only:
    there a request of n = max_num_seqs holds every slot until it ends."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", max_num_seqs=8, max_seqs_per_request=4)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"^n: 5 sequences at once, more than one request may hold \(4 of an engine's 8"):
        engine.add_request("too-wide", "hi", SamplingParams(n=5, max_tokens=4))
    with pytest.raises(ValueError, match=r"^beam_width: 5 sequences at once, more than one request may hold"):
        engine.add_request("too-wide", "hi", BeamSearchParams(beam_width=5, max_tokens=4))
    assert not engine.has_unfinished_requests()
    engine.add_request("wide", "hi", SamplingParams(n=4, max_tokens=400, ignore_eos=True, seed=1))
    engine.step()
    engine.add_request("chat", "hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    finished: list[str] = []
    while "chat" not in finished:
        finished += [output.request_id for output in engine.step() if output.finished]
    assert "wide" not in finished
    engine.abort_request(["wide"])
    while engine.has_unfinished_requests():
        engine.step()
