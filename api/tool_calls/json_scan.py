"""JSON values in text that may stop anywhere (a streamed output so far).

Only positions are computed: where a value ends, or None while the text ends inside it.
A call's arguments are then a slice of the model's own text, so the arguments streamed so
far are always a prefix of the final ones (re-serializing a partial object would not be).
A stream parses its whole text again at every delta, so the scans jump between the
characters that matter with regular expressions (C speed), never a Python loop per character.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

_WHITESPACE = " \t\n\r"
# A whole string, escapes included (the unrolled loop: the fastest form for Python's re).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STRUCTURAL = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r"[,}\]\s]")


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value starting at text[i], or None if the text ends
    first. Only nesting, strings and escapes are followed: json.loads judges validity."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "{[":
        # A number or literal ends at a delimiter; at the end of the text it may go on.
        delimiter = _SCALAR_END.search(text, i)
        return delimiter.start() if delimiter else None
    depth, j = 0, i
    while (found := _STRUCTURAL.search(text, j)) is not None:
        char, j = found.group(), found.start()
        if char == '"':
            if (j := _string_end(text, j)) is None:
                return None
            continue
        depth += 1 if char in "{[" else -1
        j += 1
        if depth == 0:
            return j
    return None


def _string_end(text: str, i: int) -> int | None:
    """The end of the string whose opening quote is text[i]."""
    string = _STRING.match(text, i)
    return string.end() if string else None


def members(text: str, i: int) -> Iterator[tuple[str, int, int | None]]:
    """(key, value start, value end or None) of the object starting at text[i] == "{", as
    far as the text goes; stops at the object's end, at text that is not an object
    member, or at a value the text ends inside."""
    j = skip_space(text, i + 1)
    while j < len(text) and text[j] == '"':
        key_end = _string_end(text, j)
        if key_end is None:
            return
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            return
        j = skip_space(text, key_end)
        if j >= len(text) or text[j] != ":":
            return
        start = skip_space(text, j + 1)
        if start >= len(text):
            return
        end = value_end(text, start)
        yield key, start, end
        if (j := _next_item(text, end)) is None:
            return


def elements(text: str, i: int) -> Iterator[tuple[int, int | None]]:
    """(start, end or None) of each value of the array starting at text[i] == "[", as far as the text goes."""
    j = skip_space(text, i + 1)
    while j < len(text) and text[j] != "]":
        end = value_end(text, j)
        yield j, end
        if (j := _next_item(text, end)) is None:
            return


def _next_item(text: str, end: int | None) -> int | None:
    """Where the next member or element starts after a value ending at `end`; None when the
    value is unfinished, or no comma follows (the object or array ends, or the text does)."""
    if end is None:
        return None
    j = skip_space(text, end)
    if j >= len(text) or text[j] != ",":
        return None
    return skip_space(text, j + 1)
