"""`LLM`: offline batched generation in this process, shaped like vLLM's.

    from pagedq import LLM, SamplingParams
    llm = LLM(model="path/to/hf-checkpoint")
    outputs = llm.generate(["Hello", "Summarize: ..."], SamplingParams(temperature=0, max_tokens=64))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagedq.beam_search import BeamSearchParams
from pagedq.config import EngineArgs
from pagedq.front.llm_engine import LLMEngine, PromptType
from pagedq.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput, RequestOutputKind
from pagedq.sampling_params import SamplingParams


class LLM:
    def __init__(
        self,
        model: str,
        **engine_kwargs: Any,
    ):
        """`engine_kwargs`: any of EngineArgs' fields (dtype, device, block_size, ...), with its defaults."""
        unknown = set(engine_kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {sorted(unknown)}")
        args = EngineArgs(model=str(model), **engine_kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: {len(params_list)} given for {len(prompt_list)} prompts; give one or one per prompt"
                )
        request_ids = self._add_requests(prompt_list, params_list)
        return self._run(request_ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The beam_width best continuations of each prompt, best first."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        outputs = self._run(self._add_requests(prompt_list, [params] * len(prompt_list)), use_tqdm)
        tokenizer = self.get_tokenizer()
        results = []
        for output in outputs:
            sequences = []
            for completion in output.outputs:
                tokens = output.prompt_token_ids + completion.token_ids
                text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else ""
                sequences.append(BeamSearchSequence(tokens, text, completion.cumulative_logprob, completion.finish_reason))
            results.append(BeamSearchOutput(sequences))
        return results

    def _add_requests(self, prompts: list[PromptType], params: list[SamplingParams | BeamSearchParams]) -> list[str]:
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params):
                request_id = str(next(self._request_counter))
                engine.add_request(request_id, prompt, sp, output_kind=RequestOutputKind.FINAL_ONLY)
                request_ids.append(request_id)
        except ValueError:
            # All or nothing: none of this call's requests stays queued.
            engine.abort_request(request_ids)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        return request_ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until this call's requests are done. A request that fails alone fails only
        itself (RequestFailed once the others are done); a step that raises is not any one
        request's fault: every request is aborted, so the engine is empty for the next call."""
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", unit="req", disable=not use_tqdm, dynamic_ncols=True) as bar:
            generated = 0
            while engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except BaseException:
                    engine.abort_request(request_ids)
                    while engine.has_unfinished_requests():
                        engine.step()
                    raise
                for output in outputs:
                    if output.finished:
                        finished[output.request_id] = output
                        generated += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"{generated / max(bar.format_dict['elapsed'], 1e-9):.0f} out tok/s", refresh=False)
        ordered = [finished[request_id] for request_id in request_ids]
        failed = [(index, output.error) for index, output in enumerate(ordered) if output.error is not None]
        if failed:
            raise RequestFailed(failed, ordered)
        return ordered


class RequestFailed(RuntimeError):
    """Some prompts of a generate() call failed, each alone (the others ran to the end):
    `failures` holds (prompt index, error), `outputs` every prompt's output in order."""

    def __init__(self, failures: list[tuple[int, str]], outputs: list[RequestOutput]):
        index, error = failures[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        super().__init__(f"prompt {index} failed: {error}{more}")
        self.failures = failures
        self.outputs = outputs
