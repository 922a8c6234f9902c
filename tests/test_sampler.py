from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch

from pagedq.sampling_params import SamplingParams
from worker.sampler import (
    _TOP_P_CANDIDATES,
    NO_TOKEN_ALLOWED,
    Sampler,
    _apply_penalties,
    _apply_top_p,
    _apply_top_p_sorted,
    _BadWords,
)

EOS = 3


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)


def make_sampler(vocab_size: int, seed: int = 0) -> Sampler:
    return Sampler(vocab_size, eos_token_ids={EOS}, generator=torch.Generator().manual_seed(seed))


def draw_many(probs: list[float], params: SamplingParams, draws: int = 4000) -> torch.Tensor:
    """Sample `draws` rows with identical logits log(probs) in one batch; return token counts."""
    logits = torch.tensor(probs).log().expand(draws, -1).contiguous()
    out = make_sampler(len(probs))(logits, [Row(params) for _ in range(draws)])
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(probs))


PROBS = [0.5, 0.3, 0.15, 0.05]


def test_greedy_is_argmax_even_beside_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=5.0)
    rows = [Row(greedy), Row(hot), Row(greedy), Row(hot), Row(greedy), Row(greedy)]
    out = make_sampler(50)(logits, rows)
    greedy_rows = [i for i, row in enumerate(rows) if row.params.is_greedy]
    assert [out.token_ids[i] for i in greedy_rows] == logits.argmax(-1)[greedy_rows].tolist()


def test_logits_past_vocab_size_are_never_sampled():
    logits = torch.zeros(1, 10)
    logits[0, 9] = 100.0  # a padded embedding column
    out = make_sampler(8)(logits, [Row(SamplingParams(temperature=0.0))])
    assert out.token_ids[0] < 8


def test_repetition_penalty_matches_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0]])
    row = Row(SamplingParams(repetition_penalty=2.0), prompt_token_ids=[0, 0], output_token_ids=[1])
    penalised = _apply_penalties(logits, [row], [0], make_sampler(5)._prompt_tokens([row], logits.device))
    # Seen tokens 0 (prompt) and 1 (output): positive divided, negative multiplied.
    assert penalised.tolist() == [[1.0, -2.0, 0.5, -0.5, 3.0]]


@pytest.mark.parametrize("penalty", [1e-300, 1e300])
def test_an_extreme_repetition_penalty_still_samples_a_token_in_the_vocabulary(penalty):
    """Any penalty > 0 is valid (vLLM's rule). Near 0 it took the seen tokens' positive logits
    to +inf, huge it took their negative ones to -inf: every seen token -inf left nothing to
    sample, +inf made the softmax NaN, and the request failed. Kept finite, the extremes sample
    as their limits do: near 0, only seen tokens with positive logits; huge, never a seen token
    while an unseen one is there."""
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5]] * 2)
    seen = [0, 1, 2]
    rows = [Row(SamplingParams(temperature=0.7, seed=seed, repetition_penalty=penalty), prompt_token_ids=seen)
            for seed in (1, 2)]
    for token in make_sampler(4)(logits, rows).token_ids:
        assert token in ([0, 2] if penalty < 1 else [0, 2, 3])


def test_frequency_and_presence_penalties_match_hand_computation():
    logits = torch.zeros(1, 4)
    row = Row(
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        prompt_token_ids=[3, 3, 3],  # prompt tokens are not penalised by these two
        output_token_ids=[1, 1, 2],
    )
    penalised = _apply_penalties(logits, [row], [0], make_sampler(4)._prompt_tokens([row], logits.device))
    assert penalised.tolist() == [[0.0, -(2 * 0.5 + 0.25), -(0.5 + 0.25), 0.0]]


def test_each_row_penalises_its_own_prompt_whose_tokens_are_built_once_per_request():
    """Rows sharing params (offline, one SamplingParams for many prompts) each penalise their
    own prompt's tokens; a prompt's tokens go to the device once per request, kept from
    step to step, and are dropped once no row has them."""
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]] * 3)
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    a, b = [0, 3], [1, 3]
    rows = [Row(params, prompt_token_ids=a), Row(params, prompt_token_ids=b), Row(params, prompt_token_ids=a)]
    sampler = make_sampler(4)
    assert sampler(logits, rows).token_ids == [1, 0, 1]
    mask = sampler._prompts.kept()[id(a)]
    assert sampler(logits[:1], rows[:1]).token_ids == [1]
    assert sampler._prompts.kept() == {id(a): mask}


@pytest.mark.parametrize("seed", range(5))
def test_bad_words_ban_what_a_word_by_word_check_bans(seed):
    """vLLM V1's rule, checked word by word here: a word's last token is banned where its
    earlier tokens end the output, a one-token word always. The sampler's lookups ban the
    same, and a request's are built once and kept from step to step."""
    rng = random.Random(seed)
    words = [[rng.randrange(6) for _ in range(rng.randint(1, 4))] for _ in range(30)]
    lookups = _BadWords(words)
    for _ in range(200):
        output = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
        expected = {word[-1] for word in words
                    if len(output) >= len(word) - 1 and output[len(output) - len(word) + 1:] == word[:-1]}
        assert set(lookups.due(output)) == expected, (output, words)
    row = Row(SamplingParams(temperature=0.0, bad_words=["x"]), output_token_ids=[1, 2], bad_words_token_ids=words)
    sampler = make_sampler(6)
    for _ in range(2):
        token = sampler(torch.randn(1, 6), [row]).token_ids[0]
        assert token not in lookups.due(row.output_token_ids) or token == NO_TOKEN_ALLOWED
        assert [entry.words for entry in sampler._bad_words.kept().values()] == [words]
    built = sampler._bad_words.kept()[id(words)]
    sampler(torch.randn(1, 6), [row])
    assert sampler._bad_words.kept()[id(words)] is built


def test_penalties_change_greedy_choice_only_for_penalised_rows():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]] * 2)
    plain = Row(SamplingParams(temperature=0.0), prompt_token_ids=[0])
    penalised = Row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt_token_ids=[0])
    out = make_sampler(4)(logits, [plain, penalised])
    assert out.token_ids == [0, 1]  # 2.0 / 1.5 < 1.5


def test_penalty_with_out_of_vocab_token_is_a_clear_error():
    row = Row(SamplingParams(presence_penalty=1.0), output_token_ids=[99])
    with pytest.raises(ValueError, match="token ids"):
        make_sampler(4)(torch.zeros(1, 4), [row])


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.75), {0, 1}),
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # threshold 0.2 * 0.5 = 0.1
        (SamplingParams(top_k=3, top_p=0.9, min_p=0.2), {0, 1, 2}),
        (SamplingParams(top_k=-1), {0, 1, 2, 3}),
    ],
)
def test_truncation_samples_exactly_the_allowed_tokens(params, allowed):
    counts = draw_many(PROBS, params)
    assert {i for i, c in enumerate(counts.tolist()) if c > 0} == allowed


def test_min_p_applies_before_top_k_and_top_p():
    """vLLM V1's order: temperature, then min-p (an argmax-invariant logits processor)
    on the whole distribution, then top-k/top-p on what min-p left, renormalised. Here
    min-p (threshold 0.2 * 0.3 = 0.06) drops the 25 tokens of 0.01; top_p=0.6 over the
    renormalised 0.4 / 0.33 / 0.27 keeps two tokens. Top-p first would keep three."""
    probs = [0.3, 0.25, 0.2] + [0.01] * 25
    counts = draw_many(probs, SamplingParams(temperature=1.0, top_p=0.6, min_p=0.2))
    assert {i for i, c in enumerate(counts.tolist()) if c > 0} == {0, 1}


def test_top_k_renormalises_over_kept_tokens():
    counts = draw_many(PROBS, SamplingParams(top_k=2), draws=8000)
    assert abs(counts[0].item() / 8000 - 0.5 / 0.8) < 0.03


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_reshapes_distribution(temperature):
    counts = draw_many(PROBS, SamplingParams(temperature=temperature), draws=20000).float()
    expected = torch.tensor(PROBS) ** (1 / temperature)
    expected /= expected.sum()
    untempered = torch.tensor(PROBS)
    # Critical value of chi-square with 3 degrees of freedom at p = 0.001 is 16.3.
    assert chi_square(counts, expected) < 16.3
    if temperature != 1.0:
        assert chi_square(counts, untempered) > 100


def test_seeded_row_samples_the_same_alone_and_in_a_batch_of_32():
    vocab = 64
    params = SamplingParams(seed=1234, temperature=0.9, top_p=0.9, top_k=20, repetition_penalty=1.2)
    others = [
        SamplingParams(seed=7, temperature=1.3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.7, presence_penalty=1.0, logprobs=3),
    ]

    def run(batch_size: int, position: int) -> list[int]:
        gen = torch.Generator().manual_seed(99)
        logit_gen = torch.Generator().manual_seed(5)
        sampler = make_sampler(vocab, seed=batch_size)
        rows = [Row(others[i % len(others)]) for i in range(batch_size - 1)]
        target = Row(params, prompt_token_ids=[1, 2, 3])
        rows.insert(position, target)
        for _ in range(12):
            logits = torch.randn(batch_size, vocab, generator=gen)
            # The target's logits are the same whatever the batch.
            logits[position] = torch.randn(vocab, generator=logit_gen)
            out = sampler(logits, rows)
            for row, token in zip(rows, out.token_ids):
                row.output_token_ids.append(token)
        return target.output_token_ids

    alone = run(1, 0)
    assert run(32, 17) == alone
    assert run(32, 0) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_unseeded_rows_differ_across_steps():
    counts = draw_many([0.25] * 4, SamplingParams(), draws=400)
    assert (counts > 50).all()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_blocks_eos_and_stop_token_ids(ignore_eos):
    """vLLM V1's rule: before min_tokens outputs, every id in the request's
    all_stop_token_ids (its stop_token_ids and the model's eos, which is added whatever
    ignore_eos says) is masked, so ignore_eos does not let eos through early."""
    logits = torch.tensor([[0.0, 1.0, 8.0, 9.0, 0.0]])  # eos (3) best, stop id 2 next
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=ignore_eos)
    sampler = make_sampler(5)
    assert sampler(logits, [Row(params, output_token_ids=[0])]).token_ids[0] == 1
    assert sampler(logits, [Row(params, output_token_ids=[0, 0])]).token_ids[0] == EOS


def test_token_rules_are_built_once_per_request_and_shared_by_its_rows():
    """A request's n rows share its params: each row takes the greedy best of its own
    allowed ids plus its own logit_bias, whatever its neighbours ask; the masks are built on
    the device once per request (kept from step to step) and dropped once no row has them."""
    torch.manual_seed(2)
    vocab = 40
    first = SamplingParams(temperature=0.0, allowed_token_ids=list(range(0, 40, 3)), logit_bias={"3": 2.5, "4": 9.0})
    second = SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 39])
    third = SamplingParams(temperature=0.0, logit_bias={str(t): -0.5 * t for t in range(0, 40, 2)})
    rows = [Row(first), Row(second), Row(first), Row(SamplingParams(temperature=0.0)), Row(third), Row(first)]
    sampler = make_sampler(vocab)
    for _ in range(3):
        logits = torch.randn(len(rows), vocab)
        out = sampler(logits, rows)
        for i, row in enumerate(rows):
            allowed = row.params.allowed_token_ids or list(range(vocab))
            bias = row.params.logit_bias or {}
            assert out.token_ids[i] == max(allowed, key=lambda t: logits[i, t].item() + bias.get(t, 0.0))
        assert {key: (~rules.barred).nonzero().flatten().tolist() for key, rules in sampler._rules.kept().items()
                if rules.barred is not None} == {id(first): first.allowed_token_ids, id(second): second.allowed_token_ids}
    rules = sampler._rules.kept()[id(first)]
    sampler(torch.randn(2, vocab), [Row(first), Row(first)])
    assert sampler._rules.kept() == {id(first): rules}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_row_whose_masks_leave_no_token_gets_no_token_allowed(temperature, logprobs):
    """allowed_token_ids holding only eos, within min_tokens: every token is masked. The row
    gets NO_TOKEN_ALLOWED (its request then fails on its own input) instead of a token its
    rules forbid (greedy's argmax over -inf was token 0) or an id past the vocabulary; its
    neighbours sample what they sample alone, and once min_tokens is reached it takes eos."""
    torch.manual_seed(1)
    logits = torch.randn(3, 16)
    stuck = SamplingParams(temperature=temperature, allowed_token_ids=[EOS], min_tokens=4, logprobs=logprobs)
    free = SamplingParams(temperature=0.0, allowed_token_ids=[5, 6], logprobs=logprobs)
    out = make_sampler(16)(logits, [Row(free), Row(stuck), Row(free)])
    assert out.token_ids[1] == NO_TOKEN_ALLOWED
    alone = make_sampler(16)(logits[[0, 2]], [Row(free), Row(free)])
    assert [out.token_ids[0], out.token_ids[2]] == alone.token_ids
    assert [out.logprobs[0], out.logprobs[2]] == alone.logprobs
    assert make_sampler(16)(logits[[1]], [Row(stuck, output_token_ids=[0] * 4)]).token_ids == [EOS]


def test_logprobs_are_raw_with_ranks_and_include_the_sampled_token():
    logits = torch.tensor([[0.0, 1.0, 8.0, 9.0, 0.5]])
    raw = torch.log_softmax(logits[0], -1).tolist()
    # min_tokens forces the rank-3 token; penalties do not touch reported logprobs.
    params = SamplingParams(
        temperature=0.0, min_tokens=1, stop_token_ids=[2], repetition_penalty=3.0, logprobs=2
    )
    out = make_sampler(5)(logits, [Row(params, prompt_token_ids=[4])])
    assert out.token_ids == [1]
    assert out.logprobs[0] == pytest.approx(raw[1])
    entries = out.top_logprobs[0]
    assert {t: (e.rank, round(e.logprob, 5)) for t, e in entries.items()} == {
        3: (1, round(raw[3], 5)),
        2: (2, round(raw[2], 5)),
        1: (3, round(raw[1], 5)),
    }


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    rows = [Row(SamplingParams(temperature=0.0, logprobs=0)), Row(SamplingParams(temperature=0.0))]
    out = make_sampler(3)(logits.expand(2, -1), rows)
    assert list(out.top_logprobs[0]) == [1] and out.top_logprobs[0][1].rank == 1
    assert out.top_logprobs[1] is None and out.logprobs[1] is None  # it asked for none
    assert out.logprobs[0] == pytest.approx(math.log(math.e**2 / (1 + math.e**2 + math.e)))


def test_bad_logits_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="logits"):
        make_sampler(4)(torch.zeros(2, 4), [Row(SamplingParams())])
    with pytest.raises(ValueError, match="vocab_size"):
        make_sampler(4)(torch.zeros(1, 3), [Row(SamplingParams())])


def test_callers_logits_are_left_untouched():
    logits = torch.randn(3, 6)
    before = logits.clone()
    rows = [
        Row(SamplingParams(temperature=0.0, min_tokens=2, repetition_penalty=2.0)),
        Row(SamplingParams(top_k=2, top_p=0.5, min_p=0.3, seed=3)),
        Row(SamplingParams(temperature=0.5, frequency_penalty=1.0), output_token_ids=[1]),
    ]
    make_sampler(6)(logits, rows)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_p_among_the_likeliest_tokens_keeps_what_the_full_sort_keeps(seed):
    """On the CPU top-p looks among each row's most likely tokens first; on fresh random
    rows of a 4,096-token vocabulary it keeps exactly the full sort's set: peaked rows whose
    nucleus is among the candidates, flat ones whose nucleus is not (sorted whole), rows
    with top_p 1 and a tiny top_p, in one batch and each alone."""
    generator = torch.Generator().manual_seed(seed)
    vocab = 4096
    scales = [8.0, 4.0, 0.5, 0.05, 8.0, 1.0, 0.05, 3.0]
    logits = torch.randn(len(scales), vocab, generator=generator) * torch.tensor(scales)[:, None]
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.9, 1.0, 1e-9, 0.3, 0.99])
    expected = logits.clone()
    _apply_top_p_sorted(expected, top_p)
    kept = expected.isfinite().sum(dim=-1)
    assert kept.max() > _TOP_P_CANDIDATES and kept.min() == 1  # both paths and the edge cases are taken
    assert kept[4] == vocab
    batch = logits.clone()
    _apply_top_p(batch, top_p)
    assert torch.equal(batch.isfinite(), expected.isfinite())
    assert torch.equal(batch[batch.isfinite()], logits[expected.isfinite()])
    for row in range(len(scales)):
        alone = logits[row:row + 1].clone()
        _apply_top_p(alone, top_p[row:row + 1])
        assert torch.equal(alone.isfinite(), expected[row:row + 1].isfinite())
