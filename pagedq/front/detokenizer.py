"""Incremental detokenization of one sequence's output, with stop strings.

Decoding the whole output after every token costs O(length) per token. Like vLLM's
prefix/read offsets, this decodes only a short window of token ids: its first tokens were
already shown and are decoded again only as context (a token's text can depend on its
left neighbour, e.g. SentencePiece's leading space); the text the window gains past the
context's own text is new. The first window holds the prompt's last tokens, so the first
output token is decoded in context too.

A decoder may strip the first character of what it decodes (SentencePiece's Metaspace /
Strip(" ", 1) removes the leading space of the text's first token). So the context must
decode to some text: a context made only of tokens that decode to nothing (a skipped
special token) would let the strip eat the next token's space. Tokens skipped by
skip_special_tokens never enter the window (they decode to nothing in any position), and
the window slides forward only to a context that decodes to text.

Byte-level BPE can split one UTF-8 character across tokens; until the rest arrives the
window's text ends in U+FFFD. Those trailing replacement characters are never shown, and
the window slides forward only once its text ends cleanly, so that a later token can
complete the character.

Without stop strings nothing needs the text between reads, so tokens wait until someone
reads `output_text` (or `finish()`), and the window then takes every waiting token in one
decode: an offline request is decoded once, when it ends, instead of once per token.
Decoding a window of many new tokens gives the text the same tokens give one at a time
(the tests check this for byte-level BPE and SentencePiece-style decoders, whatever the
chunking).
"""

from __future__ import annotations

from collections.abc import Callable

from pagedq.sampling_params import SamplingParams

# Prompt tokens decoded as left context of the first output token (vLLM uses 5 too).
_PROMPT_CONTEXT_TOKENS = 5
_MAX_PROMPT_CONTEXT_TOKENS = 24
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._decode_ids = ids_decoder(tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._skipped_ids = _special_ids(tokenizer) if params.skip_special_tokens else frozenset()
        self._stop_strings = params.stop_strings
        # Each stop string by its last character: one ending in new text ends in one of its
        # characters, so only those are searched (1,024 stop strings cost ~230 us a token
        # when every one was searched).
        self._stops_ending_in: dict[str, list[str]] = {}
        for stop in self._stop_strings:
            self._stops_ending_in.setdefault(stop[-1], []).append(stop)
        self._include_stop_str = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Streamed text must never show a stop string's prefix that a later token turns
        # into a stop string (and so cuts); this many trailing characters wait. A stop
        # string kept in the output is never cut, so then nothing waits (as in vLLM).
        self._holdback = 0 if self._include_stop_str else max((len(s) for s in self._stop_strings), default=1) - 1

        prompt = [t for t in prompt_token_ids if t not in self._skipped_ids] if self._skipped_ids else prompt_token_ids
        context, context_text = self._prompt_context(prompt)
        self._window = context
        self._num_context_tokens = len(context)
        self._context_text = context_text
        # Characters of the window's text past the context's text that were already appended.
        self._window_emitted = 0
        self._num_output_tokens = 0
        self._text = ""
        self._done = False
        # Tokens not yet decoded (only without stop strings: see the module's docstring).
        self._waiting: list[int] = []

    @property
    def output_text(self) -> str:
        if self._waiting:
            self._decode_waiting(final=False)
        if self._done or self._holdback == 0:
            return self._text
        return self._text[: max(len(self._text) - self._holdback, 0)]

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Decode the new tokens; return the stop string that ended the text, if one did.

        `stop_terminated`: the last token is the eos or stop token that ends the
        sequence. As in vLLM V1, its text is left out unless include_stop_str_in_output
        (then a stop string may still end in it). Stop strings count only once more than
        min_tokens tokens exist, and only where they end in text of the tokens after the
        first min_tokens (vLLM V1's rule)."""
        if self._done:
            raise RuntimeError("update() after the detokenizer stopped or finished")
        if stop_terminated and not self._include_stop_str:
            new_token_ids = new_token_ids[:-1]
        if not self._stop_strings:
            skipped = self._skipped_ids
            self._waiting += [t for t in new_token_ids if t not in skipped] if skipped else new_token_ids
            return None
        searched_from = len(self._text)
        for token_id in new_token_ids:
            self._num_output_tokens += 1
            if token_id not in self._skipped_ids:
                self._window.append(token_id)
                self._append_window_text(final=False)
            if self._num_output_tokens <= self._min_tokens:
                searched_from = len(self._text)
        if self._num_output_tokens <= self._min_tokens:
            return None
        return self._cut_at_stop_string(searched_from)

    def finish(self) -> None:
        """Generation ended for another reason: show everything, even a dangling U+FFFD
        (the full decode shows it too)."""
        if not self._done:
            self._decode_waiting(final=True)
            self._done = True

    def _decode_waiting(self, final: bool) -> None:
        self._window += self._waiting
        self._waiting = []
        self._append_window_text(final)

    def _prompt_context(self, prompt: list[int]) -> tuple[list[int], str]:
        """The prompt's last tokens that decode cleanly: at least _PROMPT_CONTEXT_TOKENS,
        more if those start inside a character (as vLLM looks for a clean suffix of up to
        24). Failing that, the last few, unless they end inside a character: a prompt
        ending mid-character would lend the output its first bytes."""
        shortest = min(_PROMPT_CONTEXT_TOKENS, len(prompt))
        for length in range(shortest, min(len(prompt), _MAX_PROMPT_CONTEXT_TOKENS) + 1):
            context = list(prompt[len(prompt) - length :])
            text = self._decode(context)
            if _REPLACEMENT_CHAR not in text:
                return context, text
        context = list(prompt[len(prompt) - shortest :])
        text = self._decode(context)
        return ([], "") if text.endswith(_REPLACEMENT_CHAR) else (context, text)

    def decode_token(self, token_id: int) -> str:
        return self._decode_ids([token_id], False)

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids, self._skip_special_tokens)

    def _append_window_text(self, final: bool) -> None:
        window_text = self._decode(self._window)
        complete = window_text if final else window_text.rstrip(_REPLACEMENT_CHAR)
        start = len(self._context_text) + self._window_emitted
        if len(complete) > start:
            self._text += complete[start:]
            self._window_emitted += len(complete) - start
        if len(complete) == len(window_text):
            # The window ends on a whole character: its new tokens become the next context,
            # unless they decode to nothing (then the old context stays in front of them).
            new_context_text = self._decode(self._window[self._num_context_tokens :])
            if new_context_text:
                del self._window[: self._num_context_tokens]
                self._context_text = new_context_text
            else:
                self._context_text = window_text
            self._num_context_tokens = len(self._window)
            self._window_emitted = 0

    def _cut_at_stop_string(self, searched_from: int) -> str | None:
        """Cut at the stop string that ends first in the text appended since searched_from:
        the one a character-by-character stream would meet first, so the result does not
        depend on how the text was split into tokens."""
        best: tuple[int, int, str] | None = None
        ending_in = self._stops_ending_in
        candidates = [stop for char in set(self._text[searched_from:]) for stop in ending_in.get(char, ())]
        for stop in candidates:
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


def ids_decoder(tokenizer) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)` with tokenizer.decode's result, through the fastest
    path that gives it. transformers' decode spends ~10 us a call on argument handling
    around the tokenizers library's own decode (on an H100 run, 1.0 s of the detokenizer's
    1.2 s of host time; bench/results/2026-11-24-h100.md), and the detokenizer calls it
    twice per token. Where transformers returns the library's text unchanged (its fast
    tokenizer class, neither decode step overridden, no space clean-up), the library is
    called directly; any other tokenizer goes through transformers."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        TokenizersBackend = None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        TokenizersBackend is not None
        and isinstance(backend, Tokenizer)
        and type(tokenizer).decode is PreTrainedTokenizerBase.decode
        and type(tokenizer)._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def _special_ids(tokenizer) -> frozenset[int]:
    """The ids that decode(..., skip_special_tokens=True) drops: the special added tokens."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(token_id for token_id, token in decoder.items() if getattr(token, "special", False)) | frozenset(
        getattr(tokenizer, "all_special_ids", ())
    )
