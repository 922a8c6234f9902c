"""The engine core in a process of its own (`core_process=True`): the same outputs as in
process, token for token and text for text, over its sockets; aborts free its blocks; a
core process that dies is an error in the front within seconds, never a hang; one that
cannot start says why."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from pagedq import LLM, SamplingParams
from pagedq.front.core_client import EngineDeadError
from tests.service_helpers import processes_below

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def mixed_batch():
    prompts = [{"prompt_token_ids": [5, 6, 7]}, "the quick brown fox", {"prompt_token_ids": list(range(40, 75))}, "hi"]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.7, seed=11, max_tokens=20, ignore_eos=True, stop=["a"]),
        SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3, ignore_eos=True),
    ]
    return prompts, params


def summary(outputs):
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
          None if c.logprobs is None else [{t: round(e.logprob, 4) for t, e in entry.items()} for entry in c.logprobs])
         for c in o.outputs]
        for o in outputs
    ]


def test_a_core_process_gives_what_the_core_in_process_gives(model):
    prompts, params = mixed_batch()
    expected = summary(LLM(model, dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False))
    llm = LLM(model, dtype="float32", device="cpu", core_process=True, async_scheduling=True)
    try:
        assert llm.llm_engine.engine_core is None
        assert summary(llm.generate(prompts, params, use_tqdm=False)) == expected
        # Aborts reach the core: every block comes back.
        engine = llm.llm_engine
        engine.add_request("long", {"prompt_token_ids": [9] * 30}, SamplingParams(max_tokens=200, ignore_eos=True))
        while engine.stats()["num_running"] == 0:
            engine.step()
        engine.abort_request("long")
        assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort"]
        # Nothing is left to step: the stats alone show the freed blocks and no request running
        # (the worker publishes them from here; they stayed stale until stats read the socket).
        assert not engine.has_unfinished_requests()
        deadline = time.monotonic() + 10
        while engine.stats()["num_free_blocks"] != engine.stats()["num_total_blocks"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]
        assert engine.stats()["num_running"] == 0
    finally:
        llm.llm_engine.shutdown()
    assert llm.llm_engine.core._process.poll() is not None


def test_each_step_returns_while_a_requests_tokens_wait_for_their_chunk(model):
    """A request whose tokens come from the core in chunks (report_every_s: the worker's job
    that nobody streams) has no output between chunks, yet engine.step() returns once a
    step of the core process has gone by: the service's worker, which takes new jobs and
    writes results between steps, is never held until the next chunk (an hour away here)."""
    llm = LLM(model, dtype="float32", device="cpu", core_process=True, async_scheduling=True)
    try:
        engine = llm.llm_engine
        engine.add_request("quiet", {"prompt_token_ids": [9] * 8}, SamplingParams(max_tokens=400, ignore_eos=True),
                           report_every_s=3600.0)
        outputs, calls = [], 0
        while engine.has_unfinished_requests():
            outputs += engine.step(defer_outputs=True)
            calls += 1
        # About one call per core step (400 of them); held for the chunk, the second call
        # would have waited for the request's end.
        assert calls > 20
        assert [len(o.outputs[0].token_ids) for o in outputs] == [400]
    finally:
        llm.llm_engine.shutdown()


def _may_raise_priority() -> bool:
    probe = "import os; os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) - 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def _nice_of_threads(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, int(thread)) for thread in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _may_raise_priority(),
                    reason="a raised priority needs CAP_SYS_NICE or RLIMIT_NICE (Linux)")
def test_a_raised_core_runs_at_the_fronts_priority_while_its_batch_is_small(model):
    """core_nice below the front's holds while the core runs at least a quarter of
    max_num_seqs (here 2 of 8), on every one of its threads; below that (a burst's first
    requests, its last ones) the core yields to the front, the api and Redis admitting the rest."""
    front = os.getpriority(os.PRIO_PROCESS, 0)
    raised = max(front - 5, -20)
    llm = LLM(model, dtype="float32", device="cpu", core_process=True, core_nice=raised, max_num_seqs=8)
    try:
        engine = llm.llm_engine
        core = engine.core._process.pid
        params = SamplingParams(max_tokens=300, ignore_eos=True)

        def step_while_running(count: int) -> None:
            for _ in range(5):
                engine.step()
            assert engine.stats()["num_running"] == count

        engine.add_request("first", {"prompt_token_ids": [9] * 8}, params)
        step_while_running(1)
        assert _nice_of_threads(core) == {front}
        for name in ("second", "third"):
            engine.add_request(name, {"prompt_token_ids": [7] * 8}, params)
        step_while_running(3)
        assert _nice_of_threads(core) == {raised}
        while engine.has_unfinished_requests():
            engine.step()
        assert _nice_of_threads(core) == {front}
    finally:
        llm.llm_engine.shutdown()


def test_a_core_process_that_dies_is_an_error_not_a_hang(model):
    llm = LLM(model, dtype="float32", device="cpu", core_process=True)
    engine = llm.llm_engine
    engine.add_request("doomed", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=1000, ignore_eos=True))
    os.kill(engine.core._process.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="died"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - started < 10


def test_a_core_process_that_cannot_start_says_why(tmp_path, model):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model, dtype="float32", device="cpu", core_process=True, max_model_len=10**9)


def test_a_front_that_fails_to_load_stops_the_core_it_started(tmp_path, model):
    """The core process starts loading before the front loads its tokenizer, side by side:
    a tokenizer that does not load is the caller's error and leaves no core process behind."""
    broken = tmp_path / "model"
    shutil.copytree(model, broken)
    (broken / "tokenizer.json").write_text("not a tokenizer")
    with pytest.raises(json.JSONDecodeError) as failure:
        LLM(str(broken), dtype="float32", device="cpu", core_process=True)
    # Stopped by the failing call itself, not by the collector once the traceback (held here) goes.
    assert processes_below("pagedq.core.process") == [], failure.value


def test_an_engine_dropped_in_a_garbage_cycle_is_collected_without_a_hang(model):
    """The worker's engine is dropped with its client in one cycle: the collector may take a
    socket before the client's finalizer runs, and a finalizer that did not close it itself
    waited on it forever (the suite hung in gc). Its core process goes with it."""
    llm = LLM(model, dtype="float32", device="cpu", core_process=True)
    process = llm.llm_engine.core._process
    llm.cycle = llm
    del llm
    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(30)
    assert not collector.is_alive(), "gc hung in the core client's finalizer"
    assert process.poll() is not None
