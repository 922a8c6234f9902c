"""What any request must satisfy before it may enter an engine: one rule, applied by the
api (a 4xx naming the field), by the worker to every job it reads back from Redis, and
by `LLMEngine.add_request` (ValueError naming the field). A request that passes can only
ever fail itself; these rules keep the known poison (non-finite numbers, seeds that
overflow, more sequences than an engine can hold, text the tokenizer cannot take) out.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

# A request's integers are int64, as the engine carries them (torch's long, msgspec's
# widest): a larger top_k, priority or min_tokens passed validation and failed its job in
# the engine. Seeds too, as vLLM's (torch.iinfo(torch.long)): the n outputs of a request use
# seed + index, and a torch generator takes up to 2**64 - 1, so no n ever overflows it.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# An Idempotency-Key (POST /generate's header, `pagedq submit --idempotency-key`): what an
# HTTP header carries as it is.
IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")


_TEXTUAL = (str, list, tuple, dict)
# Types that never hold text: a list of only these (a prompt's token ids) is passed over
# in one pass in C (issuperset over map(type, ...)), not an isinstance call per item.
_NEVER_TEXT = frozenset({int, float, bool, type(None)})


def unencodable_text(value: Any) -> str | None:
    """Why `value` (a string, or lists / dicts of them) is not valid Unicode text, or None.
    A JSON body may carry a lone UTF-16 surrogate ("\\ud800"); no tokenizer takes it and
    no response holding it can be encoded."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"contains a lone UTF-16 surrogate at character {exc.start}; text must be valid Unicode"
        return None
    if isinstance(value, (list, tuple)):
        # Only what can hold text is looked into: a prompt's token ids are most of a body,
        # and every model holding them is validated a few times per request.
        if _NEVER_TEXT.issuperset(map(type, value)):
            return None
        return next((why for item in value if isinstance(item, _TEXTUAL) and (why := unencodable_text(item)) is not None), None)
    if isinstance(value, dict):
        return next((why for item in value.items() if (why := unencodable_text(list(item))) is not None), None)
    return None


class ValidInput(BaseModel):
    """Base of every request body: numbers must be finite (JSON's `Infinity` and `NaN`,
    which Python's parser takes, are refused) and text valid Unicode, each error naming its field."""

    model_config = ConfigDict(allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        why = unencodable_text(value)
        if why is not None:
            raise ValueError(why)
        return value


# JSON nested deeper than this is refused before it is parsed: Python's parser (and every
# validator after it) recurses once per level, and a 20 kB line of brackets would exhaust
# the stack. Real requests nest a handful of levels.
MAX_JSON_DEPTH = 64


def json_too_deep(raw: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a JSON text nests arrays and objects more than `limit` deep: one pass over
    its characters, brackets inside strings not counted, no recursion."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def check_width(field: str, width: int, max_num_seqs: int, max_per_request: int | None = None) -> None:
    """A request runs its n samples (or beams) side by side in one engine: more than the
    engine's `max_num_seqs` could never be scheduled, and more than `max_per_request` (a
    service's share, Settings.seqs_per_request) would hold the slots every other request
    needs until this one ended (FCFS admission never takes them back)."""
    if width > max_num_seqs:
        raise ValueError(
            f"{field}: {width} sequences at once, more than an engine runs ({max_num_seqs}, PAGEDQ_MAX_NUM_SEQS)"
        )
    if max_per_request is not None and width > max_per_request:
        raise ValueError(
            f"{field}: {width} sequences at once, more than one request may hold ({max_per_request} of an engine's "
            f"{max_num_seqs}, PAGEDQ_MAX_SEQS_PER_REQUEST)"
        )


def describe_error(field: str, message: str) -> str:
    """"field: message" for one pydantic error. pydantic words a validator's ValueError
    "Value error, <message>"; our messages start with the field they are about (a check of
    a whole body names the field it refuses), which is all a client needs."""
    message = message.removeprefix("Value error, ")
    head, colon, _ = message.partition(":")
    if not field or (colon and " " not in head and head.startswith(field)):
        return message
    return f"{field}: {message}"


def describe_invalid(exc: ValueError) -> str:
    """One line naming each invalid field (pydantic's own message spans lines and links)."""
    if isinstance(exc, ValidationError):
        return "; ".join(describe_error(".".join(str(part) for part in error["loc"]), error["msg"])
                         for error in exc.errors())
    return str(exc)
