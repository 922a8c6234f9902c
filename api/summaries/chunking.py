"""Where a document is cut into chunks: by tokens of the served model's tokenizer, each
chunk at most `budget` tokens, preferring paragraph ends, then sentence ends, with a small
overlap so a sentence cut in two is read whole by one side.

Pure functions of the token offsets, so the guarantees (no chunk over the budget, every
token in some chunk, always progress) are checked without a model."""

from __future__ import annotations

from collections.abc import Sequence

# How good a cut before a token is.
NONE, SENTENCE, PARAGRAPH = 0, 1, 2
_SENTENCE_ENDS = ".!?"


def cut_strengths(text: str, offsets: Sequence[tuple[int, int]]) -> list[int]:
    """For each token t, how good a cut right before it is (t = 0: never cut there)."""
    strengths = [NONE] * len(offsets)
    for t in range(1, len(offsets)):
        p = offsets[t][0]
        before, at = text[max(0, p - 4):p], text[p:p + 2]
        # A token may carry the whitespace before its word (BPE's " word") or not.
        ended = before.rstrip(" \t")
        spaced = ended != before or at[:1].isspace()
        if ended.endswith("\n\n") or (ended.endswith("\n") and at.startswith("\n")):
            strengths[t] = PARAGRAPH
        elif ended.endswith("\n") or (ended[-1:] in _SENTENCE_ENDS and ended[-1:] and spaced):
            strengths[t] = SENTENCE
    return strengths


def plan_chunks(strengths: Sequence[int], budget: int, overlap: int) -> list[tuple[int, int]]:
    """Token spans [start, end) covering every token, each at most `budget` long. A cut goes
    at the best boundary in the second half of the window (the latest of the best), so a
    chunk is never shorter than half the budget except the last; the next chunk starts
    `overlap` tokens back (at most a quarter of the budget, so each chunk moves on)."""
    if budget < 1:
        raise ValueError(f"budget must be at least 1 token, got {budget}")
    overlap = min(overlap, budget // 4)
    n = len(strengths)
    spans: list[tuple[int, int]] = []
    start = 0
    while n - start > budget:
        limit = start + budget
        low = start + max(1, budget // 2)
        cut = max(range(low, limit + 1), key=lambda t: (strengths[t] if t < n else NONE, t))
        spans.append((start, cut))
        start = cut - overlap
    spans.append((start, n))
    return spans
