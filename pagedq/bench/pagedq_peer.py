"""pagedq's own offline engine (`pagedq.LLM`) as a benchmark peer."""

from __future__ import annotations

import gc

import torch

from pagedq.bench.peer import Generation
from pagedq.bench.workload import Workload
from pagedq.sampling_params import SamplingParams


class PagedqPeer:
    name = "pagedq"
    counting_rule = "continuous batching; each request's max_tokens is its own output length (ignore_eos)"

    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype, seed: int,
                 engine_options: dict | None = None, breakdown: bool = False):
        self.model_dir = model_dir
        self.device = device
        self.dtype = dtype
        self.seed = seed
        # EngineArgs fields to set (core_process, async_scheduling).
        self.engine_options = engine_options or {}
        # With `breakdown`, each pass's per-step phases (pagedq.core.step_timings summaries).
        self.breakdowns: list[dict] | None = [] if breakdown else None
        # The engine steps of the last generate().
        self.last_steps: int | None = None
        self._llm = None

    def setup(self, workload: Workload) -> None:
        from pagedq import LLM

        self._llm = LLM(
            model=self.model_dir,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            seed=self.seed,
            **self.engine_options,
        )

    def generate(self, workload: Workload, progress: bool) -> Generation:
        if self._llm is None:
            raise RuntimeError(f"{self.name}: setup() must be called before generate()")
        params = [
            SamplingParams(**workload.sampling_fields(), max_tokens=length, ignore_eos=True)
            for length in workload.output_lens
        ]
        prompts = [{"prompt_token_ids": prompt} for prompt in workload.prompts]
        timings = None
        if self.breakdowns is not None:
            from pagedq.core.step_timings import StepTimings

            timings = StepTimings()
            self._llm.llm_engine.set_step_timings(timings)
        steps_before = self._llm.llm_engine.stats()["steps"]
        outputs = self._llm.generate(prompts, params, use_tqdm=progress)
        self.last_steps = self._llm.llm_engine.stats()["steps"] - steps_before
        if timings is not None:
            self._llm.llm_engine.set_step_timings(None)
            self.breakdowns.append({"decode": timings.summary(), "all": timings.summary(decode_only=False)})
        token_ids = [list(output.outputs[0].token_ids) for output in outputs]
        return Generation(token_ids, sum(len(t) for t in token_ids))

    def close(self) -> None:
        # Free the KV cache before the next peer sizes its own from free device memory.
        self._llm = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
