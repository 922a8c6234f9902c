"""What pagedq's offline engine generates for service requests: the reference the service
tests and `pagedq bench chaos` hold the service's results to."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedq import LLM, SamplingParams


def offline_outputs(model: Path | str, requests: list[dict]) -> list[list[list[int]]]:
    """What pagedq's offline engine generates for these request bodies (`prompt` or
    `prompt_token_ids`, and sampling fields): each request's outputs' token ids, with the
    worker's thread count so float reductions happen in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(model=str(model), device="cpu")
        prompts = [
            {"prompt_token_ids": body["prompt_token_ids"]} if "prompt_token_ids" in body else body["prompt"]
            for body in requests
        ]
        params = [
            SamplingParams(**{key: value for key, value in body.items() if key in SamplingParams.model_fields})
            for body in requests
        ]
        return [[list(c.token_ids) for c in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        torch.set_num_threads(threads)


def offline_greedy(model: Path | str, requests: list[dict]) -> list[list[int]]:
    """Each request's first output's token ids from the offline engine."""
    return [outputs[0] for outputs in offline_outputs(model, requests)]
