"""Turns one step's logits into one token per row, on the device, with vLLM's sampling semantics.

Order of operations (as in vLLM V1): a structured output's grammar mask is applied
before the sampler (by the engine core, as vLLM's model runner does), so logprobs see it;
logprobs from those raw logits; then logits processors that change which token wins
(allowed_token_ids, bad_words, min_tokens masking, logit_bias; then repetition /
frequency / presence penalties); greedy rows take the argmax there, so greedy equals Hugging Face's
`generate`; sampled rows go on through temperature, min-p (on the tempered distribution,
before truncation: vLLM V1 runs it as an argmax-invariant logits processor ahead of its
top-k/top-p sampler), top-k and top-p, and draw by
inverse CDF: one uniform number per row, looked up in the row's cumulative
probabilities. A seeded row takes its number from its own generator, so it samples the
same tokens alone or in any batch. (vLLM's exponential race needs a random number per
vocabulary entry; on a CPU drawing those cost more than the model's matmuls.) Every
stage runs batched over the rows that need it and is skipped when none do; what a stage
builds from a request's own lists (its allowed ids, biases, bad words, prompt) is built
once and kept while the request runs. A row whose masks leave no token at all gets
NO_TOKEN_ALLOWED, never a token they forbid: its request fails, on its own input.

`sample()` only queues device work and returns a `DeviceSample`: the step's token ids
(and logprobs, for the rows that ask) stay on the device, where the next step reads its
input tokens from them; `DeviceSample.start_copy()` queues their one copy to the host,
and `to_host()` waits for it, a step later when steps overlap. No per-row `.item()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedq.outputs import Logprob
from pagedq.sampling_params import SamplingParams
from worker.host_copy import HostCopy, to_device


class SamplingRow(Protocol):
    """What the sampler reads of a row (the engine core's Sequence matches by duck typing)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    # The outputs so far, for penalties (the engine samples penalised rows only once the
    # host knows every one of their tokens).
    output_token_ids: list[int]
    # How many outputs exist, including one still in flight (for min_tokens).
    num_output_tokens: int
    # Set when params.seed is not None: the row's own random stream, on the logits' device.
    generator: torch.Generator | None
    # params.bad_words as token id sequences (the front tokenized them); empty without.
    bad_words_token_ids: list[list[int]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Logprob of each sampled token under the raw model distribution (for
    # cumulative_logprob), for rows that asked for logprobs; None for the others.
    logprobs: list[float | None]
    # Per row when params.logprobs is not None: the top-`logprobs` tokens plus the sampled one.
    top_logprobs: list[dict[int, Logprob] | None]


class DeviceSample:
    """A step's sampling results on the device, and their way to the host."""

    def __init__(self, token_ids: torch.Tensor, num_rows: int, logprob_rows: list[int], logprob_counts: list[int],
                 logprob_tensors: tuple[torch.Tensor, ...] | None):
        self.token_ids = token_ids  # int64 [rows], on the device
        self.num_rows = num_rows
        self._logprob_rows = logprob_rows
        self._logprob_counts = logprob_counts
        # (sampled logprob [L], top values [L, K], top ids [L, K], rank of the sampled token [L])
        self._logprob_tensors = logprob_tensors
        self._copy: HostCopy | None = None

    def start_copy(self) -> None:
        """Queue the copy to the host behind the sampling work; `to_host()` then waits for it alone."""
        self._copy = HostCopy([self.token_ids, *(self._logprob_tensors or ())])

    def to_host(self) -> SamplerOutput:
        if self._copy is None:
            self.start_copy()
        token_ids, *logprob_lists = self._copy.lists()
        logprobs: list[float | None] = [None] * self.num_rows
        top_logprobs: list[dict[int, Logprob] | None] = [None] * self.num_rows
        if self._logprob_rows:
            sampled, top_values, top_ids, ranks = logprob_lists
            for j, i in enumerate(self._logprob_rows):
                k = self._logprob_counts[j]
                entry = {
                    token: Logprob(logprob=value, rank=rank + 1)
                    for rank, (token, value) in enumerate(zip(top_ids[j][:k], top_values[j][:k]))
                }
                entry.setdefault(token_ids[i], Logprob(logprob=sampled[j], rank=ranks[j]))
                logprobs[i], top_logprobs[i] = sampled[j], entry
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top_logprobs)


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
        # What a step builds from a request's params and lists, kept while its rows run: a
        # request's lists can cover most of the vocabulary, and building from them at every
        # step cost everyone in its batch (vocab 49,152, one CPU thread, n=8 rows: 40,000
        # allowed ids 43-48 ms a step, 40,000 biases 110 ms, an 8,000-token prompt's
        # repetition penalty ~9-16 ms, 2,048 bad-word sequences 2.5 ms).
        self._rules = _KeptWhileUsed(lambda params, device: _TokenRules.of(params, vocab_size, device))
        self._prompts = _KeptWhileUsed(lambda prompt, device: _token_counts([prompt], vocab_size, device)[0] > 0)
        self._bad_words = _KeptWhileUsed(lambda words, device: _BadWords(words))

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, rows).to_host()

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> DeviceSample:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab], got shape {tuple(logits.shape)}"
            )
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than vocab_size={self.vocab_size}")
        # Columns past the tokenizer's vocabulary (padded embeddings) are never sampled.
        raw = logits[:, : self.vocab_size].float()

        # One pass over the rows sorts them into the stages they need; what a row needs
        # comes from its params, worked out once per params object (rows share them).
        sampled_rows: list[int] = []
        penalised: list[int] = []
        ruled: list[int] = []
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        wanted: list[int] = []
        # Rows whose mask (grammar, allowed ids, bad words, min_tokens) might leave no token.
        masked: list[int] = []
        needs: dict[int, tuple[bool, bool, bool, bool, bool, bool] | None] = {}
        for cache in (self._rules, self._prompts, self._bad_words):
            cache.new_step()
        for i, row in enumerate(rows):
            p = row.params
            key = id(p)
            if key in needs:
                need = needs[key]
            else:
                need = needs[key] = _needs(p)
            if need is None:
                continue  # greedy, nothing else
            sampled, penalties, min_tokens, logprobs, token_rules, constrained = need
            if sampled:
                sampled_rows.append(i)
            if token_rules:
                ruled.append(i)
                if row.bad_words_token_ids:
                    banned = self._bad_words.get(row.bad_words_token_ids, raw.device).due(row.output_token_ids)
                    banned_rows += [i] * len(banned)
                    banned_tokens += banned
            if penalties:
                penalised.append(i)
            if min_tokens and row.num_output_tokens < p.min_tokens:
                banned = self._stop_ids(p)
                banned_rows += [i] * len(banned)
                banned_tokens += banned
                constrained = True
            if constrained:
                masked.append(i)
            if logprobs:
                wanted.append(i)

        processed = raw
        if ruled:
            processed = _apply_token_rules(processed, ruled, [self._rules.get(rows[i].params, raw.device) for i in ruled])
        if banned_rows:
            processed = _ban(processed, banned_rows, banned_tokens)
        if penalised:
            penalised_rows = [rows[i] for i in penalised]
            processed = _apply_penalties(processed, penalised_rows, penalised, self._prompt_tokens(penalised_rows, raw.device))
        token_ids = self._choose_tokens(processed, rows, sampled_rows)
        if masked:
            token_ids = _mark_rows_without_a_token(processed, token_ids, masked)

        # Normalised only for rows that asked for logprobs: as in vLLM V1, the others get
        # no cumulative_logprob, and a logsumexp over the vocabulary of every row cost 3%
        # of a greedy 56M run on the CPU.
        tensors = None
        counts: list[int] = []
        if wanted:
            index = to_device(wanted, torch.int64, raw.device) if len(wanted) < len(rows) else None
            wanted_raw = raw if index is None else raw[index]
            chosen = (token_ids if index is None else token_ids[index]).clamp(0, self.vocab_size - 1)
            counts = [rows[i].params.logprobs for i in wanted]
            tensors = logprob_tensors(wanted_raw, chosen, max(counts))
        return DeviceSample(token_ids, len(rows), wanted, counts, tensors)

    def _prompt_tokens(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor | None:
        """[rows, vocab] bool, the tokens of each row's prompt, for the repetition penalty
        (None when no row has one)."""
        if all(row.params.repetition_penalty == 1.0 for row in rows):
            return None
        return torch.stack([self._prompts.get(row.prompt_token_ids, device) for row in rows])

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        """What min_tokens holds back: the request's stop_token_ids and eos, even with
        ignore_eos (vLLM V1 counts eos among every request's `all_stop_token_ids`, which
        its min-tokens processor masks)."""
        return [t for t in set(params.stop_token_ids or ()) | self.eos_token_ids if 0 <= t < self.vocab_size]

    def _choose_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow], sampled_rows: list[int]) -> torch.Tensor:
        if not sampled_rows:
            return _argmax(logits)
        sampled = [rows[i] for i in sampled_rows]
        if len(sampled_rows) == len(rows):
            return self._sample(logits, sampled)
        token_ids = _argmax(logits)
        index = to_device(sampled_rows, torch.int64, logits.device)
        token_ids[index] = self._sample(logits[index], sampled)
        return token_ids

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        params = [row.params for row in rows]
        device = logits.device
        logits = logits / to_device([p.temperature for p in params], torch.float32, device)[:, None]
        if any(p.min_p > 0.0 for p in params):
            _apply_min_p(logits, to_device([p.min_p for p in params], torch.float32, device))
        if any(p.top_k > 0 for p in params):
            top_k = [p.effective_top_k for p in params]
            _apply_top_k(logits, to_device(top_k, torch.int64, device), top_k)
        if any(p.top_p < 1.0 for p in params):
            _apply_top_p(logits, to_device([p.top_p for p in params], torch.float32, device))
        cdf = logits.softmax(dim=-1).cumsum_(dim=-1)
        total = cdf[:, -1:]
        # The first token whose cumulative probability passes u * total. A masked token adds
        # nothing to the sum, so no u can land on it; u < 1 keeps the target below the total.
        target = torch.minimum(self._uniforms(rows, logits.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1)

    def _uniforms(self, rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
        """One U[0, 1) number per row; a seeded row's comes from its own generator."""
        seeded = [i for i, row in enumerate(rows) if row.generator is not None]
        if not seeded:
            return torch.rand(len(rows), generator=self.generator, device=device)
        u = torch.empty(len(rows), device=device)
        if len(seeded) < len(rows):
            unseeded = [i for i, row in enumerate(rows) if row.generator is None]
            u[to_device(unseeded, torch.int64, device)] = torch.rand(len(unseeded), generator=self.generator, device=device)
        for i in seeded:
            u[i] = torch.rand(1, generator=rows[i].generator, device=device)[0]
        return u


# The token id of a row whose masks allowed no token at all (the request fails, its own input's fault).
NO_TOKEN_ALLOWED = -1
# Sampling with a temperature below this is deterministic argmax (SamplingParams.is_greedy).
_GREEDY_EPS = 1e-5


def _needs(p: SamplingParams) -> tuple[bool, bool, bool, bool, bool, bool] | None:
    """(sampled, penalties, min_tokens, logprobs, token rules, masked: its grammar, allowed
    ids or bad words may leave no token), or None for plain greedy rows."""
    need = (
        p.temperature >= _GREEDY_EPS,
        p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0,
        p.min_tokens > 0,
        p.logprobs is not None,
        bool(p.allowed_token_ids or p.logit_bias or p.bad_words),
        bool(p.allowed_token_ids or p.bad_words) or p.structured_outputs is not None,
    )
    return need if any(need) else None


def _mark_rows_without_a_token(logits: torch.Tensor, token_ids: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """NO_TOKEN_ALLOWED for each of `rows` whose masks left every token at -inf (what it
    chose is then -inf too: argmax's first column, or past the end for an inverse CDF of
    NaN). Its own constraints contradict each other (e.g. allowed_token_ids holding only eos
    within min_tokens), so it must fail, and not with a token none of them allow."""
    index = to_device(rows, torch.int64, logits.device)
    chosen = token_ids[index]
    none_left = logits[index, chosen.clamp(0, logits.shape[1] - 1)] == float("-inf")
    return token_ids.index_put((index,), torch.where(none_left, NO_TOKEN_ALLOWED, chosen))


class _KeptWhileUsed:
    """What `build(source, device)` makes of a request's params or lists, made once and kept
    while each step uses it: new_step() starts a step, and whatever the step before got and
    this one does not is dropped. By identity: each entry keeps its source, so an id stays
    that source's while the entry lives."""

    def __init__(self, build: Callable[[object, torch.device], object]):
        self._build = build
        self._before: dict[int, tuple[object, object]] = {}
        self._now: dict[int, tuple[object, object]] = {}

    def new_step(self) -> None:
        self._before, self._now = self._now, {}

    def get(self, source, device: torch.device):
        key = id(source)
        entry = self._now.get(key)
        if entry is None:
            entry = self._before.get(key)
            if entry is None or entry[0] is not source:
                entry = (source, self._build(source, device))
            self._now[key] = entry
        return entry[1]

    def kept(self) -> dict[int, object]:
        """The step's values, by id of their source."""
        return {key: value for key, (_, value) in self._now.items()}


class _BadWords:
    """A request's bad words (token id sequences) as lookups, each word's last token by the
    tokens before it: a step checks one tail of the output per word length, not every word
    (2,048 sequences were ~2 ms of every step for n=8 rows)."""

    __slots__ = ("words", "always", "by_prefix")

    def __init__(self, words: list[list[int]]):
        self.words = words
        self.always = [word[0] for word in words if len(word) == 1]
        # len(prefix) -> {prefix: the last tokens of the words it begins}
        self.by_prefix: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for word in words:
            if len(word) > 1:
                self.by_prefix.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), []).append(word[-1])

    def due(self, output: list[int]) -> list[int]:
        """The tokens that would complete a bad word now: a word's last token, where its
        earlier tokens end the output (vLLM V1's rule: a one-token word is always banned;
        the prompt does not count)."""
        banned = list(self.always)
        for length, table in self.by_prefix.items():
            if len(output) >= length and (last := table.get(tuple(output[-length:]))):
                banned += last
        return banned


@dataclass
class _TokenRules:
    """A request's allowed_token_ids and logit_bias as [vocab] rows on the device."""

    params: SamplingParams
    # True for each token allowed_token_ids leaves out (None: no such list).
    barred: torch.Tensor | None
    # logit_bias, dense (None: none).
    bias: torch.Tensor | None

    @classmethod
    def of(cls, p: SamplingParams, vocab_size: int, device: torch.device) -> _TokenRules:
        barred = bias = None
        if p.allowed_token_ids:
            barred = torch.ones(vocab_size, dtype=torch.bool, device=device)
            barred[to_device(p.allowed_token_ids, torch.int64, device)] = False
        if p.logit_bias:
            bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            bias[to_device(list(p.logit_bias), torch.int64, device)] = to_device(list(p.logit_bias.values()),
                                                                                 torch.float32, device)
        return cls(p, barred, bias)


def _apply_token_rules(logits: torch.Tensor, rows: list[int], rules: list[_TokenRules]) -> torch.Tensor:
    """allowed_token_ids (every other token to -inf), then logit_bias (added), for `rows`
    (row i under rules[i])."""
    device = logits.device
    limited = [(row, r.barred) for row, r in zip(rows, rules) if r.barred is not None]
    if limited:
        index = to_device([row for row, _ in limited], torch.int64, device)
        barred = torch.stack([mask for _, mask in limited])
        logits = logits.index_put((index,), logits[index].masked_fill(barred, float("-inf")))
    biased = [(row, r.bias) for row, r in zip(rows, rules) if r.bias is not None]
    if biased:
        index = to_device([row for row, _ in biased], torch.int64, device)
        logits = logits.index_put((index,), logits[index] + torch.stack([bias for _, bias in biased]))
    return logits


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest entry, as torch.argmax gives it. On a CPU through numpy,
    whose argmax is vectorised: torch's took 17 ms for 256 rows of 32,000 logits on one
    thread here, numpy's 1.4 ms (a 56M model's greedy step on two threads takes ~70 ms)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=1))
    return logits.argmax(dim=-1)


def _ban(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> torch.Tensor:
    device = logits.device
    indices = (to_device(rows, torch.int64, device), to_device(tokens, torch.int64, device))
    return logits.index_put(indices, torch.full((), float("-inf"), device=device))


# Far beyond any logit a model gives, and still finite after the smallest temperature that
# samples (1e-5) divides it.
_PENALISED_LOGIT_LIMIT = 1e30


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow], penalised: list[int],
                     prompt_tokens: torch.Tensor | None) -> torch.Tensor:
    """HF/vLLM repetition penalty over prompt and output tokens (positive logits divided,
    negative multiplied), then frequency and presence penalties over output tokens, for
    the rows at `penalised` (`rows` are those rows; `prompt_tokens` their prompts' tokens,
    Sampler._prompt_tokens)."""
    device, vocab_size = logits.device, logits.shape[1]
    params = [row.params for row in rows]
    index = to_device(penalised, torch.int64, device)
    sub = logits[index]
    output_counts = _token_counts([row.output_token_ids for row in rows], vocab_size, device)

    if prompt_tokens is not None:
        seen = (output_counts > 0) | prompt_tokens
        penalty = to_device([p.repetition_penalty for p in params], torch.float32, device)[:, None]
        penalty = torch.where(seen, penalty, 1.0)
        # Kept finite: a penalty near 0 or huge (both valid, > 0) took logits to ±inf, and
        # the softmax of those is NaN: the request failed ("token id outside the vocabulary").
        sub = torch.where(sub > 0, sub / penalty, sub * penalty).clamp(-_PENALISED_LOGIT_LIMIT, _PENALISED_LOGIT_LIMIT)
    frequency = to_device([p.frequency_penalty for p in params], torch.float32, device)[:, None]
    presence = to_device([p.presence_penalty for p in params], torch.float32, device)[:, None]
    sub = sub - frequency * output_counts - presence * (output_counts > 0)
    return logits.index_put((index,), sub)


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float counts of each token id in each list."""
    # Checked on the host, before an out-of-range id could become a device-side assert.
    if any(t and (min(t) < 0 or max(t) >= vocab_size) for t in token_lists):
        raise ValueError(f"token ids must be in [0, {vocab_size}) for penalties")
    width = max((len(t) for t in token_lists), default=0)
    # Pad with an extra column's id so padding lands in a column that is dropped.
    padded = to_device([t + [vocab_size] * (width - len(t)) for t in token_lists], torch.int64, device)
    padded = padded.reshape(len(token_lists), width)
    counts = torch.zeros((len(token_lists), vocab_size + 1), device=device)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, host_top_k: list[int]) -> None:
    """Keep each row's top_k highest logits (ties with the k-th kept); 0 keeps all.
    `host_top_k` is top_k as a host list: the width of the topk comes from it (reading it
    from the device would wait for the device)."""
    vocab_size = logits.shape[1]
    top_k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
    width = vocab_size if 0 in host_top_k else min(max(host_top_k), vocab_size)
    top_values = logits.topk(width, dim=-1).values
    kth_value = top_values.gather(1, (top_k - 1)[:, None])
    logits.masked_fill_(logits < kth_value, float("-inf"))


# On the CPU, top-p first looks among each row's most likely tokens: torch.topk of 256 of
# SmolLM2's 49,152 logits took 9 ms for 64 rows on one thread, the full sort 203 ms (57% of
# a served engine core's time with SmolLM2's default top_p 0.9).
_TOP_P_CANDIDATES = 256


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    if logits.device.type == "cpu" and logits.shape[1] > _TOP_P_CANDIDATES:
        _apply_top_p_among_candidates(logits, top_p)
    else:
        _apply_top_p_sorted(logits, top_p)


def _apply_top_p_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    logits.masked_fill_(_top_p_removed_sorted(logits, top_p), float("-inf"))


def _top_p_removed_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    return _top_p_removed(sorted_logits.softmax(dim=-1), top_p, order, logits.shape[1])


def _apply_top_p_among_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """The same set as the full sort, found among each row's _TOP_P_CANDIDATES most likely
    tokens where their probability reaches top_p; the other rows are sorted whole (on the
    CPU, telling which rows they are costs no wait)."""
    top_logits, order = logits.topk(_TOP_P_CANDIDATES, dim=-1)
    top_probs = (top_logits - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    removed = _top_p_removed(top_probs, top_p, order, logits.shape[1])
    within = (top_probs.sum(dim=-1) >= top_p) | (top_p >= 1.0)
    if not within.all():
        others = (~within).nonzero().squeeze(1)
        removed[others] = _top_p_removed_sorted(logits[others], top_p[others])
    logits.masked_fill_(removed, float("-inf"))


def _top_p_removed(sorted_probs: torch.Tensor, top_p: torch.Tensor, order: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] True where a token goes: `sorted_probs` are the rows' most likely
    tokens' probabilities, descending, at the ids `order`; tokens not in `order` go."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Rows with top_p == 1 keep everything, even when rounding pushes the sum past 1.
    keep_all = top_p[:, None] >= 1.0
    remove = (mass_before >= top_p[:, None]) & ~keep_all
    # The most likely token always stays (as vLLM's): a top_p below float32's smallest
    # value rounds to 0 and would otherwise remove every token.
    remove[:, 0] = False
    removed = keep_all.logical_not().expand(-1, vocab_size).clone()
    return removed.scatter_(1, order, remove)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens less likely than min_p times the row's most likely token."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    logits.masked_fill_(probs < threshold, float("-inf"))


def logprob_tensors(logits: torch.Tensor, chosen: torch.Tensor, max_k: int) -> tuple[torch.Tensor, ...]:
    """Per row (every row asked for logprobs), on the device: the sampled token's logprob,
    the top-`max_k` logprobs and their ids, and the sampled token's rank (vLLM's: 1 + the
    number of tokens strictly more likely)."""
    normalizer = torch.logsumexp(logits, dim=-1)[:, None]
    chosen_logit = logits.gather(1, chosen[:, None])
    ranks = (logits > chosen_logit).sum(dim=-1) + 1
    top_values, top_ids = logits.topk(max_k, dim=-1)
    return (chosen_logit.squeeze(1) - normalizer.squeeze(1)), top_values - normalizer, top_ids, ranks
