"""Incremental detokenization of one sequence's output, with stop strings.

Decoding the whole output after every token costs O(length) per token. Like vLLM's
prefix/read offsets, this decodes only a short window of token ids: its first tokens were
already shown and are decoded again only as context (a token's text can depend on its
left neighbour, e.g. SentencePiece's leading space); the text the window gains past the
context's own text is new. The first window holds the prompt's last tokens, so the first
output token is decoded in context too.

Byte-level BPE can split one UTF-8 character across tokens; until the rest arrives the
window's text ends in U+FFFD. Those trailing replacement characters are never shown, and
the window slides forward only once its text ends cleanly, so that a later token can
complete the character.
"""

from __future__ import annotations

from pagedq.sampling_params import SamplingParams

# Prompt tokens decoded as left context of the first output token (vLLM uses 5 too).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop_strings = params.stop_strings
        self._include_stop_str = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Streamed text must never show a stop string's prefix that a later token turns
        # into a stop string (and so cuts); this many trailing characters wait.
        self._holdback = max((len(s) for s in self._stop_strings), default=1) - 1

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT_CHAR):
            # A prompt ending inside a character would lend the output its first bytes.
            context, context_text = [], ""
        self._window = context
        self._num_context_tokens = len(context)
        self._context_text = context_text
        # Characters of the window's text past the context's text that were already appended.
        self._window_emitted = 0
        self._num_output_tokens = 0
        self._text = ""
        self._done = False

    @property
    def output_text(self) -> str:
        if self._done or self._holdback == 0:
            return self._text
        return self._text[: max(len(self._text) - self._holdback, 0)]

    def update(self, new_token_ids: list[int]) -> str | None:
        """Decode the new tokens; return the stop string that ended the text, if one did."""
        if self._done:
            raise RuntimeError("update() after the detokenizer stopped or finished")
        if not new_token_ids:
            return None
        self._window.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        searched_from = len(self._text)
        self._append_window_text(final=False)
        if self._num_output_tokens < self._min_tokens:
            # vLLM ignores stop strings until min_tokens tokens exist.
            return None
        return self._cut_at_stop_string(searched_from)

    def finish(self) -> None:
        """Generation ended for another reason: show everything, even a dangling U+FFFD
        (the full decode shows it too)."""
        if not self._done:
            self._append_window_text(final=True)
            self._done = True

    def decode_token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _append_window_text(self, final: bool) -> None:
        window_text = self._decode(self._window)
        complete = window_text if final else window_text.rstrip(_REPLACEMENT_CHAR)
        start = len(self._context_text) + self._window_emitted
        if len(complete) > start:
            self._text += complete[start:]
            self._window_emitted += len(complete) - start
        if len(complete) == len(window_text):
            # The window ends on a whole character: its new tokens become the next context.
            del self._window[: self._num_context_tokens]
            self._num_context_tokens = len(self._window)
            self._context_text = self._decode(self._window)
            self._window_emitted = 0

    def _cut_at_stop_string(self, searched_from: int) -> str | None:
        """Cut at the stop string that ends first in the text appended since searched_from:
        the one a character-by-character stream would meet first, so the result does not
        depend on how the text was split into tokens."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop_strings:
            index = self._text.find(stop, max(searched_from - len(stop) + 1, 0))
            if index != -1:
                candidate = (index + len(stop), index, stop)
                best = candidate if best is None else min(best, candidate)
        if best is None:
            return None
        _, index, stop = best
        self._text = self._text[: index + len(stop) if self._include_stop_str else index]
        self._done = True
        return stop
