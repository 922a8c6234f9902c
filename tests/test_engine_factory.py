"""The worker's engine is built from Settings: PAGEDQ_* engine knobs reach EngineArgs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedq.settings import Settings
from worker.host_threads import limit_host_threads_for_gpu, set_torch_threads
from worker.rq.engine_factory import build_engine


def test_engine_settings_reach_the_engine(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # build_engine sets it (the worker's thread count): restored after
    for name, value in {
        "MODEL": str(tiny_model_dir("llama")), "DEVICE": "cpu", "KV_CACHE_DTYPE": "fp8",
        "ENABLE_PREFIX_CACHING": "false", "PREEMPTION_MODE": "swap", "SWAP_SPACE": "0.001",
        "BLOCK_SIZE": "8", "MAX_NUM_BATCHED_TOKENS": "64", "NUM_GPU_BLOCKS": "40", "ASYNC_SCHEDULING": "true",
        "CORE_NICE": str(min(os.getpriority(os.PRIO_PROCESS, 0) + 3, 19)),  # a lower priority needs no privilege
    }.items():
        monkeypatch.setenv(f"PAGEDQ_{name}", value)
    engine = build_engine(Settings())
    args = engine.args
    assert (args.kv_cache_dtype, args.enable_prefix_caching, args.preemption_mode) == ("fp8", False, "swap")
    assert (args.block_size, args.max_num_batched_tokens, args.num_gpu_blocks_override) == (8, 64, 40)
    # What the core reports, wherever it runs (the worker's own process or one of its own).
    info = engine.core.info
    assert args.async_scheduling and info.max_steps_in_flight == 2
    assert info.num_cpu_blocks > 0 and info.num_gpu_blocks == 40
    # The core process and every thread it started (torch's, zmq's) run at core_nice; the worker at its own.
    core = engine.core._process.pid
    threads = [int(thread) for thread in os.listdir(f"/proc/{core}/task")]
    assert len(threads) > 1
    assert {os.getpriority(os.PRIO_PROCESS, thread) for thread in threads} == {args.core_nice}
    assert os.getpriority(os.PRIO_PROCESS, 0) == args.core_nice - 3 or args.core_nice == 19
    engine.shutdown()


def _may_run_realtime() -> bool:
    probe = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def test_the_engine_core_runs_at_real_time_priority_when_asked(tiny_model_dir, monkeypatch):
    """PAGEDQ_CORE_REALTIME_PRIORITY: the core process and every thread it started run under
    SCHED_FIFO at that priority (where this machine allows it; else normally, as before); the
    worker's own threads keep normal scheduling."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # build_engine sets it (the worker's thread count): restored after
    engine = build_engine(Settings(model=str(tiny_model_dir("llama")), device="cpu", core_realtime_priority=3))
    try:
        threads = [int(thread) for thread in os.listdir(f"/proc/{engine.core._process.pid}/task")]
        assert len(threads) > 1
        policies = {(os.sched_getscheduler(thread), os.sched_getparam(thread).sched_priority) for thread in threads}
        assert policies == ({(os.SCHED_FIFO, 3)} if _may_run_realtime() else {(os.SCHED_OTHER, 0)})
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    finally:
        engine.shutdown()


def test_a_bad_engine_setting_is_a_clear_error(tiny_model_dir):
    settings = Settings(model=str(tiny_model_dir("llama")), device="cpu", preemption_mode="sometimes")
    with pytest.raises(ValueError, match="preemption_mode"):
        build_engine(settings)


def test_a_cuda_engine_shrinks_the_host_thread_pool_unless_told(monkeypatch):
    # setenv first so that monkeypatch restores the variable's absence afterwards.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("OMP_NUM_THREADS")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        limit_host_threads_for_gpu()
        assert torch.get_num_threads() == 1
        set_torch_threads(2)  # explicit, as PAGEDQ_TORCH_THREADS or bench --threads do
        limit_host_threads_for_gpu()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
