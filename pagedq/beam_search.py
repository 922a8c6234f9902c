"""Beam search's bookkeeping for one request: which beams are alive, what each proposed
this round, and the finished hypotheses. No tensors or engine state: the engine reports
each live beam's top log-probabilities and acts on `advance()`'s choice, forking the
chosen beams (their KV blocks shared copy-on-write) and freeing the rest.

Semantics follow vLLM's `LLM.beam_search`: every round each live beam proposes its
2 × beam_width most likely next tokens; a proposal ending in EOS (unless ignore_eos) is a
finished hypothesis; the best beam_width others, ranked by length-penalised score, live
on. After max_tokens rounds the live beams join the finished ones, and the best
beam_width of all are the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Generic, TypeVar

from pydantic import ConfigDict, Field

from pagedq.request_rules import ValidInput

BeamT = TypeVar("BeamT")

# Scores divide by length ** length_penalty: past these, with lengths up to a context's,
# that overflowed or went to 0 (1e300 failed the request with OverflowError, -1e300 with
# ZeroDivisionError: a 500 for the client's own input). vLLM's are unbounded; 1 is usual.
LengthPenalty = Annotated[float, Field(ge=-10.0, le=10.0)]


class BeamSearchParams(ValidInput):
    model_config = ConfigDict(extra="forbid", strict=True)

    beam_width: int = Field(ge=1, le=64)
    max_tokens: int = Field(ge=1)
    length_penalty: LengthPenalty = 1.0
    ignore_eos: bool = False


def beam_score(num_tokens: int, cum_logprob: float, ends_with_eos: bool, length_penalty: float) -> float:
    """Length-normalised log-probability; `num_tokens` counts the prompt, an ending EOS does not."""
    length = num_tokens - 1 if ends_with_eos else num_tokens
    return cum_logprob / (length**length_penalty)


@dataclass
class Hypothesis:
    output_token_ids: list[int]
    cum_logprob: float
    ends_with_eos: bool


@dataclass
class Proposal(Generic[BeamT]):
    """A live beam continued by one token."""

    parent: BeamT
    token_id: int
    cum_logprob: float


@dataclass
class BeamSearch(Generic[BeamT]):
    params: BeamSearchParams
    prompt_len: int
    eos_token_ids: set[int]
    live: list[BeamT] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)
    rounds: int = 0
    # This round's reports: beam -> (its output ids, its cum logprob, [(token, logprob)]).
    _reports: dict[int, tuple[BeamT, list[int], float, list[tuple[int, float]]]] = field(default_factory=dict)

    @property
    def num_candidates(self) -> int:
        return 2 * self.params.beam_width

    def report(self, beam: BeamT, output_token_ids: list[int], cum_logprob: float, top: list[tuple[int, float]]) -> bool:
        """Record a live beam's most likely next tokens; True once every live beam has
        reported this round. A beam reporting again (recomputed after preemption) changes nothing."""
        self._reports.setdefault(id(beam), (beam, list(output_token_ids), cum_logprob, top))
        return len(self._reports) == len(self.live)

    def advance(self, max_total_len: int) -> list[Proposal[BeamT]]:
        """Close the round: returns the proposals that live on (an empty list when the search is over)."""
        self.rounds += 1
        penalty = self.params.length_penalty
        candidates: list[tuple[float, Proposal[BeamT], list[int]]] = []
        for beam, tokens, cum, top in self._reports.values():
            for token, logprob in top:
                output = tokens + [token]
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    self.finished.append(Hypothesis(output, cum + logprob, True))
                    continue
                score = beam_score(self.prompt_len + len(output), cum + logprob, False, penalty)
                candidates.append((score, Proposal(beam, token, cum + logprob), output))
        self._reports.clear()
        candidates.sort(key=lambda c: c[0], reverse=True)
        chosen = candidates[: self.params.beam_width]
        done = self.rounds >= self.params.max_tokens or self.prompt_len + self.rounds >= max_total_len
        if done or not chosen:
            self.finished += [Hypothesis(output, proposal.cum_logprob, False) for _, proposal, output in chosen]
            return []
        return [proposal for _, proposal, _ in chosen]

    def best(self) -> list[Hypothesis]:
        penalty = self.params.length_penalty
        ranked = sorted(
            self.finished,
            key=lambda h: beam_score(self.prompt_len + len(h.output_token_ids), h.cum_logprob, h.ends_with_eos, penalty),
            reverse=True,
        )
        return ranked[: self.params.beam_width]
