"""What a chat request's tools ask of the service, by vLLM's rules:

- no tools, or tool_choice "none": plain content (tools still reach the chat template);
- "auto" (the default when tools are given): the model's own calls, parsed by the server's
  --tool-call-parser; without --enable-auto-tool-choice it is refused, as vLLM refuses it;
- "required" / a named function: structured outputs force the calls, so they need no parser:
  for a named function its parameters' schema, for "required" vLLM's array of
  {name, parameters} objects, anyOf the tools.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from api.tool_calls import parsers
from api.tool_calls.schemas import NamedToolChoice, Tool, ToolChoice
from pagedq.request_rules import describe_invalid
from pagedq.structured_outputs_params import StructuredOutputsParams

# A function without parameters takes an empty object (vLLM's default).
_NO_PARAMETERS = {"type": "object", "properties": {}}
_ALPHANUMERIC = string.ascii_letters + string.digits
# The parsers that read the text with special tokens kept (vLLM's hermes and mistral parsers
# ask for it: [TOOL_CALLS] and some tokenizers' <tool_call> are special tokens).
_KEEP_SPECIAL_TOKENS = {"hermes", "mistral"}


@dataclass(frozen=True)
class ToolPlan:
    parse: parsers.Parser
    # "required" and "auto" answer finish_reason "tool_calls" for calls made; a named
    # function keeps the engine's reason ("stop"), as vLLM and OpenAI answer.
    calls_finish: bool
    # A call's id from its output's key and its place in the output (call_id()).
    new_id: Callable[[str], str]
    # What the request's sampling must be: the shape forcing the calls, or the text kept whole for the parser.
    sampling_overrides: dict

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and self.calls_finish and reason == "stop" else reason

    def call_id(self, output_key: str, index: int) -> str:
        """The id of the output's `index`th call. `output_key` names the output (output_key()),
        so every answer from one job, a retry's with its Idempotency-Key and a stream's, gives
        a call the same id, which a client's tool turn may have quoted already."""
        return self.new_id(f"{output_key}/{index}")

    def message(self, text: str, reason: str | None, output_key: str) -> tuple[dict, str | None]:
        """A finished output's assistant message (content null beside calls, as OpenAI's) and finish_reason."""
        parsed = self.parse(text, True)
        message: dict = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [
                {"id": self.call_id(output_key, index), "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for index, call in enumerate(parsed.calls)
            ]
        return message, self.finish_reason(reason, bool(parsed.calls))


def plan(tools: list[Tool] | None, choice: ToolChoice | None, auto_parser: str | None) -> ToolPlan | None:
    """The request's ToolPlan, or None when its output is plain content; ValueError naming
    the field for what cannot be served. `auto_parser`: the server's --tool-call-parser when
    --enable-auto-tool-choice is on."""
    if choice not in (None, "none") and not tools:
        raise ValueError("tool_choice: needs `tools` (vLLM: When using `tool_choice`, `tools` must be set.)")
    if not tools or choice == "none":
        return None
    new_id = _mistral_id if auto_parser == "mistral" else _tool_id
    if choice in (None, "auto"):
        if auto_parser is None:
            raise ValueError('tool_choice: "auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                             "to be set (pagedq api / pagedq up flags); or name a function, or use \"required\"")
        overrides = {"skip_special_tokens": False} if auto_parser in _KEEP_SPECIAL_TOKENS else {}
        return ToolPlan(parsers.FAMILIES[auto_parser], True, new_id, overrides)
    if isinstance(choice, NamedToolChoice):
        index = next((i for i, tool in enumerate(tools) if tool.function.name == choice.function.name), None)
        if index is None:
            raise ValueError(f"tool_choice.function.name: `{choice.function.name}` is not one of the `tools`")
        schema = _parameters(tools, index)
        return ToolPlan(parsers.named(choice.function.name), False, new_id, _forced(schema))
    schemas = [_parameters(tools, index) for index in range(len(tools))]
    try:
        forced = _forced(_required_schema(tools, schemas))
    except ValueError as exc:  # the tools together, e.g. more of them than a schema's anyOf may hold
        raise ValueError(f'tools: with tool_choice "required", {describe_invalid(exc)}') from None
    return ToolPlan(parsers.required, True, new_id, forced)


def _parameters(tools: list[Tool], index: int) -> dict[str, Any]:
    """A tool's parameters schema, checked to compile (what xgrammar cannot follow would
    fail the job later; here it is a 400 naming the tool)."""
    schema = tools[index].function.parameters or _NO_PARAMETERS
    try:
        StructuredOutputsParams.model_construct(json_schema=schema).to_grammar()
    except ValueError as exc:  # "structured_outputs.json: <xgrammar's reason>"
        reason = str(exc).partition(": ")[2]
        raise ValueError(f"tools[{index}].function.parameters: not a JSON schema structured outputs can follow: {reason}") from None
    return schema


def _forced(schema: dict[str, Any]) -> dict:
    return {"structured_outputs": StructuredOutputsParams(json=schema)}


def _required_schema(tools: list[Tool], schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's schema for "required": at least one {name, parameters}, each anyOf the tools;
    the tools' `$defs` are gathered at the top, where their `#/$defs/...` references point."""
    defs: dict[str, Any] = {}
    options = []
    for tool, schema in zip(tools, schemas):
        for name, definition in schema.get("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise ValueError(f"tools: two tools define `$defs.{name}` differently; rename one")
        parameters = {key: value for key, value in schema.items() if key != "$defs"}
        options.append({
            "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
            "required": ["name", "parameters"],
        })
    array = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    return {**array, "$defs": defs} if defs else array


def output_key(seq_id: str, choice_index: int) -> str:
    """What names one output of a response: its first job's id (the response's id) and its choice's index."""
    return f"{seq_id}:{choice_index}"


def _digest(seed: str) -> int:
    return int.from_bytes(hashlib.blake2b(seed.encode(), digest_size=16).digest(), "big")


def _tool_id(seed: str) -> str:
    """vLLM's form (chatcmpl-tool- and 32 hex digits), drawn from the seed instead of at random."""
    return f"chatcmpl-tool-{_digest(seed):032x}"


def _mistral_id(seed: str) -> str:
    """Mistral's chat templates refuse any id but 9 letters and digits (vLLM's MistralToolCall ids)."""
    digest, letters = _digest(seed), []
    for _ in range(9):
        digest, at = divmod(digest, len(_ALPHANUMERIC))
        letters.append(_ALPHANUMERIC[at])
    return "".join(letters)
