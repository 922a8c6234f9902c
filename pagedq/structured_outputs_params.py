"""StructuredOutputsParams: the shape a request's output must take (vLLM V1's field of
the same name): a JSON schema, any JSON object, a regular expression, one of a list of
choices, or a grammar (EBNF as xgrammar and llama.cpp's GBNF write it, or Lark).

The one conversion of these into an xgrammar `Grammar` is `to_grammar()`: the api and
`SamplingParams` call it to refuse what cannot compile (a 4xx naming the field, before
any job exists), and the engine core calls it again to compile the grammar against its
tokenizer. Converting needs no tokenizer and takes well under a millisecond.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ConfigDict, Field, StrictBool, StrictStr, model_validator

from pagedq.request_rules import MAX_JSON_DEPTH, ValidInput, json_too_deep

_KINDS = ("json_schema", "regex", "choice", "grammar", "json_object")
_NAMES = {kind: "json" if kind == "json_schema" else kind for kind in _KINDS}
# The deepest nesting of groups a schema's `pattern` may have: xgrammar refuses deeper regexes
# of its own (the `regex` kind), but converts a schema's patterns without that check, and one
# nested ~25,000 deep overflowed its C stack: the api process died (SIGSEGV).
MAX_PATTERN_NESTING = 1000
# A grammar's compile time (against the tokenizer, in the engine core) grows faster than its
# alternatives: 4,000 choices 0.05 s, 8,000 0.6 s, 16,000 9 s here on a 512-token vocabulary
# (a larger vocabulary costs more). Unbounded, 20,000 choices held a core of a 2-core machine
# for 20 s, and the engine beside it slowed to a crawl: a bystander waited 19 s, at 40,000
# 130 s. So choices, a schema's enum values and anyOf / oneOf branches, and the text of a
# regex or grammar are bounded.
MAX_ALTERNATIVES = 1024
MAX_REGEX_CHARS = 16 * 1024
MAX_GRAMMAR_CHARS = 64 * 1024
# xgrammar's C++ errors start with "[hh:mm:ss] /project/cpp/file.cc:123: ": the user needs what follows.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class StructuredOutputsParams(ValidInput):
    # `json` is vLLM's name; in Python it would shadow BaseModel.json, so the attribute is json_schema.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_by_name=True, serialize_by_alias=True)

    json_schema: dict[str, Any] | StrictStr | None = Field(
        None, alias="json", description="A JSON schema (an object or its JSON text)."
    )
    regex: StrictStr | None = Field(None, max_length=MAX_REGEX_CHARS)
    choice: list[StrictStr] | None = Field(None, min_length=1, max_length=MAX_ALTERNATIVES,
                                           description="The output is exactly one of these.")
    grammar: StrictStr | None = Field(None, max_length=MAX_GRAMMAR_CHARS,
                                      description="EBNF (xgrammar / GBNF, rule `root`) or Lark (rule `start`).")
    json_object: StrictBool | None = Field(None, description="Any JSON object (OpenAI's response_format json_object).")
    disable_any_whitespace: StrictBool = Field(
        False, description="JSON without whitespace between tokens (models tend to loop on whitespace otherwise)."
    )

    @model_validator(mode="after")
    def _one_kind_that_compiles(self) -> StructuredOutputsParams:
        given = [_NAMES[kind] for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(_NAMES.values())} (got {', '.join(given) or 'none'})")
        self.to_grammar()
        return self

    @property
    def kind(self) -> str:
        """The one field given, by its wire name (json, regex, choice, grammar, json_object)."""
        return next(_NAMES[kind] for kind in _KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> str:
        """Equal for requests that compile to the same grammar."""
        return json.dumps(self.model_dump(exclude_defaults=True), sort_keys=True)

    def to_grammar(self):
        """The xgrammar Grammar; ValueError naming the field and xgrammar's reason when it does not convert."""
        import xgrammar as xgr  # the api imports this module; xgrammar loads only when a request uses it

        kind = self.kind
        try:
            if kind == "json":
                schema = self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
                _check_schema_shape(schema)
                return xgr.Grammar.from_json_schema(schema, any_whitespace=not self.disable_any_whitespace)
            if kind == "json_object":
                if self.disable_any_whitespace:
                    return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
                return xgr.Grammar.from_json_schema('{"type": "object"}')
            if kind == "regex":
                return xgr.Grammar.from_regex(self.regex)
            if kind == "choice":
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in self.choice))
            return _grammar_from_text(xgr, self.grammar)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"structured_outputs.{kind}: {_reason(exc)}") from None


def preload_grammar_engine() -> None:
    """Import xgrammar now (2.5 s here: it brings torch and transformers), so that the first
    request with a shape does not stall every other request behind that import. The api
    calls it on a thread at startup, the worker before it takes jobs."""
    import xgrammar  # noqa: F401


def _check_schema_shape(schema: str) -> None:
    """Refuses a schema whose conversion would take the process down or hold it: nested
    deeper than a request body may be (its conversion time grows steeply with depth: 14 ms at
    64 levels, 3 s at 400, a minute at 1,000; a schema given as text escaped the body's check),
    with a pattern nested deeper than MAX_PATTERN_NESTING, or with more than MAX_ALTERNATIVES
    enum values or anyOf / oneOf branches in one place."""
    if json_too_deep(schema):
        raise ValueError(f"the schema nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        parsed = json.loads(schema)
    except ValueError:
        return  # xgrammar says what is wrong with it
    stack = [parsed]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
            if isinstance(node.get("patternProperties"), dict):
                patterns += list(node["patternProperties"])
            for pattern in patterns:
                if _group_nesting(pattern) > MAX_PATTERN_NESTING:
                    raise ValueError(f"a pattern nests groups more than {MAX_PATTERN_NESTING} deep")
            for keyword in ("enum", "anyOf", "oneOf"):
                if isinstance(node.get(keyword), list) and len(node[keyword]) > MAX_ALTERNATIVES:
                    raise ValueError(f"{keyword} has {len(node[keyword])} entries, at most {MAX_ALTERNATIVES}")
            stack.extend(node.values())


def _group_nesting(pattern: str) -> int:
    """How deep a regex's groups nest (escapes and character classes skipped)."""
    depth = deepest = 0
    escaped = in_class = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth -= 1
    return deepest


def _grammar_from_text(xgr, text: str):
    """EBNF first (its root rule is `root`); a grammar that names `start` is Lark's."""
    try:
        return xgr.Grammar.from_ebnf(text)
    except RuntimeError as ebnf_error:
        if not re.search(r"^\s*\??start\s*:", text, re.MULTILINE):
            raise ebnf_error
        return xgr.Grammar.from_lark(text)


def _reason(exc: Exception) -> str:
    return _CPP_PREFIX.sub("", str(exc).strip()).strip()
