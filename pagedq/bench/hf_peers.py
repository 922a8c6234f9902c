"""The Hugging Face transformers peers: padded static batches through `model.generate`, and
transformers' own continuous batching with paged attention (the engine behind
`model.generate_batch`).

Both share one loaded model. EOS is disabled for both, so like pagedq's `ignore_eos=True`
every request decodes its full length and the model's logits are never altered (forcing
length with `min_new_tokens` would instead mask the EOS logit and change greedy outputs).
"""

from __future__ import annotations

import math
from functools import cached_property

import torch
from tqdm import tqdm

from pagedq.bench.peer import Generation
from pagedq.bench.workload import Workload

# Same per-step token budget as pagedq's default (EngineArgs.max_num_batched_tokens).
CB_MAX_BATCH_TOKENS = 2048


class HFModel:
    """The checkpoint loaded once with transformers, shared by the HF peers."""

    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype):
        self.model_dir = model_dir
        self.device = device
        self.dtype = dtype

    @cached_property
    def model(self):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=self.dtype, attn_implementation="sdpa", local_files_only=True
        ).to(self.device)
        model.eval()
        # None values in a generation config fall back to the model's own: clear EOS there.
        model.generation_config.eos_token_id = None
        return model

    def sampling_kwargs(self, temperature: float) -> dict:
        if temperature == 0.0:
            return {"do_sample": False}
        # top_k=0 and top_p=1.0: plain temperature sampling, as pagedq's defaults.
        return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


class HFGeneratePeer:
    name = "hf-generate"

    def __init__(self, hf: HFModel, batch_size: int, seed: int):
        self.hf = hf
        self.batch_size = batch_size
        self.seed = seed
        self.counting_rule = (
            f"static batches of {batch_size} in workload order, left-padded; each batch decodes to its longest "
            "request's output length and each request counts only its own length (the rest is computed_tokens)"
        )

    def setup(self, workload: Workload) -> None:
        self.hf.model  # noqa: B018 -- load outside the timed region

    def generate(self, workload: Workload, progress: bool) -> Generation:
        from transformers import GenerationConfig

        torch.manual_seed(self.seed)
        token_ids: list[list[int]] = []
        computed = 0
        with tqdm(total=workload.num_requests, desc=self.name, unit="req", disable=not progress) as bar:
            for start in range(0, workload.num_requests, self.batch_size):
                prompts = workload.prompts[start : start + self.batch_size]
                lengths = workload.output_lens[start : start + self.batch_size]
                input_ids, attention_mask = self._left_pad(prompts)
                config = GenerationConfig(
                    max_new_tokens=max(lengths), pad_token_id=0, **self.hf.sampling_kwargs(workload.temperature)
                )
                with torch.inference_mode():
                    out = self.hf.model.generate(
                        input_ids=input_ids, attention_mask=attention_mask, generation_config=config
                    )
                generated = out[:, input_ids.shape[1] :].tolist()
                computed += sum(len(row) for row in generated)
                token_ids.extend(row[:length] for row, length in zip(generated, lengths))
                bar.update(len(prompts))
        return Generation(token_ids, computed)

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        return input_ids.to(self.hf.device), attention_mask.to(self.hf.device)

    def close(self) -> None:
        pass


class HFGenerateBatchPeer:
    """transformers' continuous batching. `generate_batch` takes one max_new_tokens for all
    requests, so this drives the same manager it uses, giving each request its own length."""

    name = "hf-generate-batch"
    counting_rule = "continuous batching; each request's max_new_tokens is its own output length"

    def __init__(self, hf: HFModel, seed: int):
        self.hf = hf
        self.seed = seed
        self._manager = None
        self._temperature: float | None = None
        # Request ids must be unique for the manager's lifetime (warm-up, then the timed pass).
        self._runs = 0

    def setup(self, workload: Workload) -> None:
        """Starts a manager whose cache and hints are sized for the full workload."""
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        generation_config = GenerationConfig(
            eos_token_id=-1, max_new_tokens=max(workload.output_lens), **self.hf.sampling_kwargs(workload.temperature)
        )
        cb_config = ContinuousBatchingConfig(seed=self.seed)
        if self.hf.device.type == "cpu":
            # On CPU transformers sizes the cache from system RAM (60% of it): size it to hold
            # every request at once instead, as pagedq's CPU cache does for this workload.
            cb_config.max_batch_tokens = CB_MAX_BATCH_TOKENS
            cb_config.num_blocks = sum(
                math.ceil((len(p) + n) / cb_config.page_size) for p, n in zip(workload.prompts, workload.output_lens)
            )
        hints = WorkloadHints(
            max_prompt_length=max(len(p) for p in workload.prompts),
            max_generated_length=max(workload.output_lens),
            num_requests=workload.num_requests,
        )
        manager = self.hf.model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_config, workload_hints=hints
        )
        manager.warmup()
        manager.start()
        self._manager = manager
        self._temperature = workload.temperature

    def generate(self, workload: Workload, progress: bool) -> Generation:
        if self._manager is None or workload.temperature != self._temperature:
            raise RuntimeError(f"{self.name}: setup() must be called with this workload before generate()")
        manager = self._manager
        self._runs += 1
        request_ids = [f"run{self._runs}-{index}" for index in range(workload.num_requests)]
        for request_id, prompt, length in zip(request_ids, workload.prompts, workload.output_lens):
            manager.add_request(prompt, request_id=request_id, max_new_tokens=length, eos_token_id=-1)
        results = {}
        with tqdm(total=workload.num_requests, desc=self.name, unit="req", disable=not progress) as bar:
            while len(results) < workload.num_requests:
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError(f"{self.name}: the generation thread stopped unexpectedly")
                    continue
                if result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"{self.name}: request {result.request_id} failed: {result.error}")
                    results[result.request_id] = result
                    bar.update(1)
        token_ids = [list(results[request_id].generated_tokens) for request_id in request_ids]
        return Generation(token_ids, sum(len(t) for t in token_ids))

    def close(self) -> None:
        if self._manager is not None:
            self._manager.stop(block=True, timeout=30)
            self._manager.destroy()
            self._manager = None
