"""A model's text to its content and tool calls: one parser per chat-template family
(vLLM's --tool-call-parser names) and one per forced shape (tool_choice `required` or a
named function).

A parser reads the whole text so far, finished (`final`) or still being streamed, and
answers the same way both times, so a stream's deltas add up to the finished answer:
content never takes back what it gave (text that may still become a tool-call marker is
held back until it does or cannot), and a call's arguments are the model's own JSON
text, which only grows. A finished text whose calls are not valid JSON has no calls: all
of it is content, as vLLM answers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from api.tool_calls.json_scan import elements, members, skip_space, value_end

# The keys a call object names its arguments by (Llama 3's templates write "parameters").
_ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class Call:
    name: str | None  # None until the text has named the function
    arguments: str = ""  # the arguments' JSON text so far
    complete: bool = False  # the text has closed the call


@dataclass
class Parsed:
    content: str | None
    calls: list[Call] = field(default_factory=list)


Parser = Callable[[str, bool], Parsed]


def hermes(text: str, final: bool) -> Parsed:
    """Hermes and Qwen 2.5/3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
    block per call; the content is what precedes the first block."""
    return _marked(text, final, "<tool_call>", _one_call)


def mistral(text: str, final: bool) -> Parsed:
    """Mistral: `[TOOL_CALLS]` then a JSON array of {name, arguments} (tokenizers before v11),
    or `name{...}` / `name[ARGS]{...}` after each `[TOOL_CALLS]` (v11 and later)."""
    return _marked(text, final, "[TOOL_CALLS]", _mistral_calls)


def llama3_json(text: str, final: bool) -> Parsed:
    """Llama 3.1-3.3 JSON tool calling: the whole reply is `{"name": ..., "parameters": {...}}`
    (optionally after `<|python_tag|>`; several separated by `;`); any other reply is content."""
    tag = "<|python_tag|>"
    start = skip_space(text, 0)
    if text.startswith(tag, start):
        start = skip_space(text, start + len(tag))
    elif not final and tag.startswith(text[start:]):
        return Parsed(None)  # nothing yet, or what may be the start of the tag
    if start >= len(text):
        return Parsed(text if final else None)
    if text[start] != "{":
        return Parsed(text)
    calls = []
    while True:
        call, end = _object_call(text, start)
        calls.append(call)
        if end is None:
            break
        separator = skip_space(text, end)
        if not text.startswith(";", separator) or (start := skip_space(text, separator + 1)) >= len(text):
            break
    return _checked(text, final, Parsed(None, calls))


def required(text: str, final: bool) -> Parsed:
    """tool_choice "required": the JSON array vLLM's schema forces, [{"name": ..., "parameters": {...}}, ...]."""
    start = skip_space(text, 0)
    if start >= len(text) or text[start] != "[":
        return Parsed(text if final else None)
    return _checked(text, final, Parsed(None, _array_calls(text, start)[0]))


def named(name: str) -> Parser:
    """A named tool_choice: the whole text is the arguments of that function (the schema is its parameters)."""
    return lambda text, final: Parsed(None, [Call(name, text, final)])


FAMILIES: dict[str, Parser] = {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral}


# ---- shared pieces ----------------------------------------------------------------------


def _marked(text: str, final: bool, marker: str, calls_at: Callable[[str, int], tuple[list[Call], int | None]]) -> Parsed:
    """Content up to the first `marker`, then a call (or calls) after each marker."""
    first = text.find(marker)
    if first < 0:
        return Parsed(text if final else _held_back(text, marker))
    calls: list[Call] = []
    at = first
    while at >= 0:
        start = skip_space(text, at + len(marker))
        if start >= len(text):
            break
        found, end = calls_at(text, start)
        calls += found
        if end is None:
            break
        at = text.find(marker, end)
    return _checked(text, final, Parsed(text[:first] or None, calls))


def _held_back(text: str, marker: str) -> str:
    """The text without its end where that end could be the beginning of `marker`."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return text[:-keep]
    return text


def _one_call(text: str, start: int) -> tuple[list[Call], int | None]:
    call, end = _object_call(text, start)
    return [call], end


def _object_call(text: str, start: int) -> tuple[Call, int | None]:
    """The call object {"name": ..., "arguments": {...}} at text[start], and where it ends (None: not yet)."""
    if text[start] != "{":
        return Call(None), len(text)  # not a call object: _checked refuses it
    call, last = Call(None), skip_space(text, start + 1)
    for key, value_start, last in members(text, start):
        if key == "name" and last is not None:
            try:
                name = json.loads(text[value_start:last])
            except ValueError:
                name = None
            call.name = name if isinstance(name, str) else None
        elif key in _ARGUMENT_KEYS:
            call.arguments = text[value_start:len(text) if last is None else last]
    end = _closed(text, last, "}")
    call.complete = end is not None
    return call, end


def _closed(text: str, last: int | None, closer: str) -> int | None:
    """The end of an object or array whose last member or element ends at `last` (its
    opening, if none), when `closer` follows (found here, the members need no second scan)."""
    if last is None:
        return None
    close = skip_space(text, last)
    return close + 1 if text.startswith(closer, close) else None


def _array_calls(text: str, start: int) -> tuple[list[Call], int | None]:
    """The call objects of the array at text[start] == "[", and where it ends."""
    calls, last = [], skip_space(text, start + 1)
    for element, _ in elements(text, start):
        call, last = _object_call(text, element)
        calls.append(call)
        if last is None:
            break
    return calls, _closed(text, last, "]")


def _mistral_calls(text: str, start: int) -> tuple[list[Call], int | None]:
    if text[start] == "[":
        return _array_calls(text, start)
    # name{...} or name[ARGS]{...}: the name is known once its arguments begin.
    opening = re.compile(r"\s*(\[ARGS\])?\s*\{").search(text, start)
    if opening is None:
        return [Call(None)], None
    arguments_start = opening.end() - 1
    end = value_end(text, arguments_start)
    arguments = text[arguments_start:len(text) if end is None else end]
    return [Call(text[start:opening.start()].strip() or None, arguments, end is not None)], end


def _checked(text: str, final: bool, parsed: Parsed) -> Parsed:
    """A finished text's calls must each be complete, named, with a JSON object for
    arguments; if one is not, the text had no calls (vLLM returns it all as content)."""
    if not final:
        return parsed
    for call in parsed.calls:
        if not call.complete or not call.name:
            return Parsed(text)
        try:
            arguments = json.loads(call.arguments or "{}")
        except (ValueError, RecursionError):  # a model's text nested past Python's stack is not a call either
            return Parsed(text)
        if not isinstance(arguments, dict):
            return Parsed(text)
        call.arguments = call.arguments or "{}"
    return parsed if parsed.calls else Parsed(text)
