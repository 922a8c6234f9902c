"""A summary batch's prompts and jobs: a document's map prompts (its chunks, each in the map
template), a stage's reduce prompts (partial summaries grouped to fit the reduce template),
and the job payload of each, all sized by the served model's context."""

from __future__ import annotations

from api.jobs import JobStore
from api.prompts import PromptChecker
from api.summaries.chunking import cut_strengths, plan_chunks
from api.summaries.prompts import SEPARATOR, frame
from pagedq.protocol import GenerateRequest, JobPayload
from pagedq.summaries import DEFAULT_MAX_TOKENS, SummarizeOptions

# A map prompt must leave the text at least this many tokens.
MIN_CHUNK_TOKENS = 16


class InvalidOptions(ValueError):
    """Options the served model cannot run; the message names the field."""


class Summarizer:
    def __init__(self, checker: PromptChecker, options: SummarizeOptions, priority: int):
        self.checker = checker
        self.options = options
        self.priority = priority
        try:
            with checker.borrowed() as tokenizer:
                self.map_frame = frame(tokenizer, options.map_template, options.chat)
                self.reduce_frame = frame(tokenizer, options.reduce_template, options.chat)
                self.separator = tokenizer.encode(SEPARATOR, add_special_tokens=False)
        except ValueError as exc:
            raise InvalidOptions(f"summary.{exc}") from None
        # The most a summary may have for a reduce prompt to hold two (see part_budget below).
        most = (checker.token_limit - self.reduce_frame.overhead) // 3 - len(self.separator) - 1
        self.max_tokens = options.max_tokens or max(1, min(DEFAULT_MAX_TOKENS, most))
        room = checker.token_limit - self.max_tokens  # what a prompt may take
        self.chunk_budget = room - self.map_frame.overhead
        # Each partial summary may fill half a reduce prompt, so a reduce always combines at
        # least two and every stage at least halves what is left.
        self.part_budget = (room - self.reduce_frame.overhead) // 2 - len(self.separator)
        if self.chunk_budget < MIN_CHUNK_TOKENS:
            raise InvalidOptions(
                f"summary.max_tokens: {self.max_tokens} output tokens and the map template's "
                f"{self.map_frame.overhead} leave {self.chunk_budget} of the model's {checker.token_limit} tokens "
                f"for each chunk, fewer than {MIN_CHUNK_TOKENS}")
        if self.part_budget < self.max_tokens:
            raise InvalidOptions(
                f"summary.max_tokens: a reduce prompt of the model's {checker.token_limit} tokens cannot hold two "
                f"summaries of {self.max_tokens} tokens and the reduce template's {self.reduce_frame.overhead}; "
                f"ask for at most {most} tokens")

    def chunks(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The document's token ids and the spans of its chunks."""
        with self.checker.borrowed() as tokenizer:
            # verbose=False: a document is meant to be longer than the model's context; no warning.
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
        return ids, plan_chunks(cut_strengths(text, offsets), self.chunk_budget, self.options.overlap_tokens)

    def map_prompts(self, text: str) -> list[list[int]]:
        ids, spans = self.chunks(text)
        return [self.map_frame.around(ids[start:end]) for start, end in spans]

    def reduce_prompts(self, summaries: list[str]) -> list[list[int]]:
        """Consecutive partial summaries, as many per prompt as fit, in order."""
        with self.checker.borrowed() as tokenizer:
            parts = [tokenizer.encode(text, add_special_tokens=False)[:self.part_budget] for text in summaries]
        budget = 2 * (self.part_budget + len(self.separator))
        groups: list[list[int]] = []
        for part in parts:
            if groups and len(groups[-1]) + len(self.separator) + len(part) <= budget:
                groups[-1].extend([*self.separator, *part])
            else:
                groups.append(list(part))
        return [self.reduce_frame.around(group) for group in groups]

    def payload(self, prompt_token_ids: list[int]) -> JobPayload:
        fields = {"temperature": self.options.temperature} if self.options.temperature is not None else {}
        request = GenerateRequest(prompt_token_ids=prompt_token_ids, max_tokens=self.max_tokens,
                                  priority=self.priority, stream=False, **fields)
        return JobStore.payload(self.checker.with_generation_defaults(request), prompt_token_ids)
