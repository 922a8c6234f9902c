"""How summary batches cut documents and build their prompts (api/summaries/), on the tiny
model's own tokenizer: no chunk over its budget, every token of the document in some chunk,
cuts on paragraph and sentence ends, reduce prompts that fit and always combine at least
two summaries, options the model cannot run refused naming the field."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.prompts import PromptChecker
from api.summaries.chunking import NONE, PARAGRAPH, SENTENCE, cut_strengths, plan_chunks
from api.summaries.summarizer import InvalidOptions, Summarizer
from pagedq.settings import Settings
from pagedq.summaries import SummarizeOptions

WORDS = "the board met on monday to review budget risks and hiring plans for next quarter".split()


def document(paragraphs: int, seed: int = 0) -> str:
    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + rng.choice(".!?")

    return "\n\n".join(" ".join(sentence() for _ in range(rng.randint(1, 6))) for _ in range(paragraphs)) + "\n"


@pytest.fixture(scope="module")
def checker(tiny_model_dir):
    return PromptChecker(Settings(model=str(tiny_model_dir()), max_model_len=160))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([NONE, NONE, NONE, SENTENCE, PARAGRAPH]), max_size=400),
       st.integers(1, 80), st.integers(0, 40))
def test_chunks_never_exceed_the_budget_and_cover_every_token(strengths, budget, overlap):
    spans = plan_chunks(strengths, budget, overlap)
    assert all(end - start <= budget for start, end in spans)
    assert spans[0][0] == 0 and spans[-1][1] == len(strengths)
    for (start, end), (next_start, next_end) in zip(spans, spans[1:]):
        assert start < next_start <= end < next_end  # contiguous or overlapping, always moving on
        assert end - next_start <= max(overlap, 0) and end - next_start <= budget // 4


def test_cuts_prefer_paragraph_then_sentence_ends():
    text = "One two. Three four\n\nFive six seven. Eight"
    offsets = [(m, m + len(w)) for m, w in _words(text)]
    strengths = cut_strengths(text, offsets)
    assert [text[offsets[t][0]:offsets[t][1]] for t, s in enumerate(strengths) if s == PARAGRAPH] == ["Five"]
    assert [text[offsets[t][0]:offsets[t][1]] for t, s in enumerate(strengths) if s == SENTENCE] == ["Three", "Eight"]
    # Budget 6 from "One": the cut goes at the paragraph end (before "Five"), not at the limit.
    assert plan_chunks(strengths, 6, 0)[0] == (0, 4)


def _words(text: str) -> list[tuple[int, str]]:
    import re
    return [(m.start(), m.group()) for m in re.finditer(r"\S+", text)]


def test_map_prompts_fit_the_context_and_hold_every_document_token(checker):
    options = SummarizeOptions(max_tokens=8, overlap_tokens=10)
    summarizer = Summarizer(checker, options, priority=10)
    text = document(40)
    ids, spans = summarizer.chunks(text)
    prompts = summarizer.map_prompts(text)
    assert len(prompts) == len(spans) > 5
    assert max(len(prompt) for prompt in prompts) <= checker.max_model_len - options.max_tokens
    covered = set().union(*(range(start, end) for start, end in spans))
    assert covered == set(range(len(ids)))
    for prompt, (start, end) in zip(prompts, spans):
        assert prompt == [*summarizer.map_frame.prefix, *ids[start:end], *summarizer.map_frame.suffix]
        assert prompt[:len(summarizer.map_frame.prefix)] == prompts[0][:len(summarizer.map_frame.prefix)]  # one prefix
    # Most cuts fall on a paragraph or sentence end (the rest only where none was in reach).
    with checker.borrowed() as tokenizer:
        cuts = [tokenizer.decode(ids[:end]).rstrip(" ") for _, end in spans[:-1]]
    assert sum(cut.endswith(("\n", ".", "!", "?")) for cut in cuts) >= 0.8 * len(cuts)


def test_reduce_prompts_fit_and_each_combines_at_least_two(checker):
    options = SummarizeOptions(max_tokens=8)
    summarizer = Summarizer(checker, options, priority=10)
    summaries = [f"Part {i} says the budget grew." for i in range(23)]
    prompts = summarizer.reduce_prompts(summaries)
    assert 1 < len(prompts) <= (len(summaries) + 1) // 2
    assert max(len(prompt) for prompt in prompts) <= checker.max_model_len - options.max_tokens
    # Everything is there, in order.
    with checker.borrowed() as tokenizer:
        text = "".join(tokenizer.decode(p[len(summarizer.reduce_frame.prefix):len(p) - len(summarizer.reduce_frame.suffix)])
                       + "\n\n" for p in prompts)
    assert [line for line in text.split("\n\n") if line] == summaries


def test_options_the_model_cannot_run_are_refused_naming_the_field(checker, tiny_model_dir):
    with pytest.raises(InvalidOptions, match=r"^summary.max_tokens: .* ask for at most"):
        Summarizer(checker, SummarizeOptions(max_tokens=40), priority=10)
    with pytest.raises(InvalidOptions, match=r"^summary.max_tokens: .* for each chunk"):
        Summarizer(checker, SummarizeOptions(max_tokens=100, reduce_template="{text}"), priority=10)
    with pytest.raises(ValueError, match="exactly once"):
        SummarizeOptions(map_template="Summarize this.")
    chat = Summarizer(checker, SummarizeOptions(max_tokens=8, chat=True), priority=10)
    with checker.borrowed() as tokenizer:
        rendered = tokenizer.decode(chat.map_prompts("Quarterly numbers.")[0])
    assert "Quarterly numbers." in rendered and rendered.index("Summarize") < rendered.index("Quarterly")
