"""Turns one step's logits into one token per sequence, with vLLM's sampling semantics.

Order of operations (as in vLLM): logprobs from the raw logits; then logits processors
that change which token wins (min_tokens masking, repetition / frequency / presence
penalties); greedy rows take the argmax there, so greedy equals Hugging Face's
`generate`; sampled rows go on through temperature, min-p (on the tempered distribution,
before truncation: vLLM V1 runs it as an argmax-invariant logits processor ahead of its
top-k/top-p sampler), top-k and top-p, and draw by
inverse CDF: one uniform number per row, looked up in the row's cumulative
probabilities. A seeded row takes its number from its own generator, so it samples the
same tokens alone or in any batch. (vLLM's exponential race needs a random number per
vocabulary entry; on a CPU drawing those cost more than the model's matmuls.) Every
stage runs batched over the rows that need it and is skipped when none do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedq.outputs import Logprob
from pagedq.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What the sampler reads from a sequence (the engine's Sequence matches by duck typing)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Set when params.seed is not None; must live on the logits' device.
    generator: torch.Generator | None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Logprob of each sampled token under the raw model distribution (for
    # cumulative_logprob), for rows that asked for logprobs; None for the others.
    logprobs: list[float | None]
    # Per row when params.logprobs is not None: the top-`logprobs` tokens plus the sampled one.
    top_logprobs: list[dict[int, Logprob] | None]


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: set[int],
        generator: torch.Generator | None = None,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        # Noise for unseeded rows; None uses torch's default generator of the logits' device.
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab], got shape {tuple(logits.shape)}"
            )
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than vocab_size={self.vocab_size}")
        # Columns past the tokenizer's vocabulary (padded embeddings) are never sampled.
        raw = logits[:, : self.vocab_size].float()
        params = [row.params for row in rows]

        processed = _apply_penalties(self._mask_stops_before_min_tokens(raw, rows), rows)
        token_ids = self._choose_tokens(processed, rows)

        # Normalised only for rows that asked for logprobs: as in vLLM V1, the others get
        # no cumulative_logprob, and a logsumexp over the vocabulary of every row cost 3%
        # of a greedy 56M run on the CPU.
        logprobs: list[float | None] = [None] * len(rows)
        top_logprobs: list[dict[int, Logprob] | None] = [None] * len(rows)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            index = torch.tensor(wanted, device=raw.device) if len(wanted) < len(rows) else None
            wanted_raw = raw if index is None else raw[index]
            chosen = token_ids if index is None else token_ids[index]
            normalizer = torch.logsumexp(wanted_raw, dim=-1)
            sampled = (wanted_raw.gather(1, chosen[:, None]).squeeze(1) - normalizer).tolist()
            tops = _top_logprobs(wanted_raw, normalizer, chosen, [params[i] for i in wanted])
            for j, i in enumerate(wanted):
                logprobs[i], top_logprobs[i] = sampled[j], tops[j]
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs, top_logprobs=top_logprobs)

    def _mask_stops_before_min_tokens(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> torch.Tensor:
        """Until a row has min_tokens outputs, none of its stop tokens may be generated:
        its stop_token_ids and eos, even with ignore_eos (vLLM V1 counts eos among every
        request's `all_stop_token_ids`, which its min-tokens processor masks)."""
        row_index: list[int] = []
        token_index: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if len(row.output_token_ids) >= p.min_tokens:
                continue
            banned = [t for t in set(p.stop_token_ids or ()) | self.eos_token_ids if 0 <= t < self.vocab_size]
            row_index += [i] * len(banned)
            token_index += banned
        if not row_index:
            return logits
        device = logits.device
        indices = (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device))
        return logits.index_put(indices, torch.tensor(float("-inf"), device=device))

    def _choose_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        greedy = [row.params.is_greedy for row in rows]
        if all(greedy):
            return logits.argmax(dim=-1)
        sampled_index = [i for i, g in enumerate(greedy) if not g]
        sampled_rows = [rows[i] for i in sampled_index]
        if len(sampled_index) == len(rows):
            return self._sample(logits, sampled_rows)
        token_ids = logits.argmax(dim=-1)
        index = torch.tensor(sampled_index, device=logits.device)
        token_ids[index] = self._sample(logits[index], sampled_rows)
        return token_ids

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        params = [row.params for row in rows]
        device = logits.device
        logits = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
        if any(p.min_p > 0.0 for p in params):
            _apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
        if any(p.effective_top_k > 0 for p in params):
            _apply_top_k(logits, torch.tensor([p.effective_top_k for p in params], device=device))
        if any(p.top_p < 1.0 for p in params):
            _apply_top_p(logits, torch.tensor([p.top_p for p in params], device=device))
        cdf = logits.softmax(dim=-1).cumsum_(dim=-1)
        total = cdf[:, -1:]
        # The first token whose cumulative probability passes u * total. A masked token adds
        # nothing to the sum, so no u can land on it; u < 1 keeps the target below the total.
        target = torch.minimum(self._uniforms(rows, logits.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1)

    def _uniforms(self, rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
        """One U[0, 1) number per row; a seeded row's comes from its own generator."""
        u = torch.empty(len(rows), device=device)
        unseeded = [i for i, row in enumerate(rows) if row.generator is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), generator=self.generator, device=device)
        for i, row in enumerate(rows):
            if row.generator is not None:
                u[i] = torch.rand(1, generator=row.generator, device=device)[0]
        return u


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """HF/vLLM repetition penalty over prompt and output tokens (positive logits divided,
    negative multiplied), then frequency and presence penalties over output tokens."""
    penalised = [
        i
        for i, row in enumerate(rows)
        if row.params.repetition_penalty != 1.0
        or row.params.frequency_penalty != 0.0
        or row.params.presence_penalty != 0.0
    ]
    if not penalised:
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    params = [rows[i].params for i in penalised]
    index = torch.tensor(penalised, device=device)
    sub = logits[index]
    output_counts = _token_counts([rows[i].output_token_ids for i in penalised], vocab_size, device)

    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _token_counts([rows[i].prompt_token_ids for i in penalised], vocab_size, device)
        seen = (output_counts > 0) | (prompt_counts > 0)
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        penalty = torch.where(seen, penalty, 1.0)
        sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    sub = sub - frequency * output_counts - presence * (output_counts > 0)
    return logits.index_put((index,), sub)


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float counts of each token id in each list."""
    # Checked on the host, before an out-of-range id could become a device-side assert.
    if any(t and (min(t) < 0 or max(t) >= vocab_size) for t in token_lists):
        raise ValueError(f"token ids must be in [0, {vocab_size}) for penalties")
    width = max((len(t) for t in token_lists), default=0)
    # Pad with an extra column's id so padding lands in a column that is dropped.
    padded = torch.tensor([t + [vocab_size] * (width - len(t)) for t in token_lists], dtype=torch.long)
    padded = padded.reshape(len(token_lists), width).to(device)
    counts = torch.zeros((len(token_lists), vocab_size + 1), device=device)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """Keep each row's top_k highest logits (ties with the k-th kept); 0 keeps all."""
    vocab_size = logits.shape[1]
    top_k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
    top_values = logits.topk(int(top_k.max()), dim=-1).values
    kth_value = top_values.gather(1, (top_k - 1)[:, None])
    logits.masked_fill_(logits < kth_value, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Rows with top_p == 1 keep everything, even when rounding pushes the sum past 1.
    remove = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    # The most likely token always stays (as vLLM's): a top_p below float32's smallest
    # value rounds to 0 and would otherwise remove every token.
    remove[:, 0] = False
    logits.masked_fill_(torch.zeros_like(remove).scatter_(1, order, remove), float("-inf"))


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens less likely than min_p times the row's most likely token."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    logits.masked_fill_(probs < threshold, float("-inf"))


def _top_logprobs(
    logits: torch.Tensor,
    log_normalizer: torch.Tensor,
    chosen: torch.Tensor,
    params: Sequence[SamplingParams],
) -> list[dict[int, Logprob]]:
    """Per row (every row asked for logprobs): the top-`logprobs` tokens plus the sampled one."""
    normalizer = log_normalizer[:, None]
    chosen_logit = logits.gather(1, chosen[:, None])
    # vLLM's rank: 1 + number of tokens strictly more likely than the sampled one.
    ranks = (logits > chosen_logit).sum(dim=-1) + 1
    max_k = max(p.logprobs for p in params)
    top_values, top_ids = logits.topk(max_k, dim=-1)
    top_values, top_ids = (top_values - normalizer).tolist(), top_ids.tolist()
    chosen_logprobs = (chosen_logit.squeeze(1) - normalizer.squeeze(1)).tolist()
    chosen, ranks = chosen.tolist(), ranks.tolist()
    result = []
    for j, p in enumerate(params):
        entry = {
            token: Logprob(logprob=value, rank=rank + 1)
            for rank, (token, value) in enumerate(zip(top_ids[j][: p.logprobs], top_values[j][: p.logprobs]))
        }
        entry.setdefault(chosen[j], Logprob(logprob=chosen_logprobs[j], rank=ranks[j]))
        result.append(entry)
    return result
