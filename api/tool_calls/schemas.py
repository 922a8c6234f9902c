"""OpenAI's tool shapes on /v1/chat/completions: the request's `tools` and `tool_choice`,
and the `tool_calls` of an assistant message sent back in a later turn."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictStr, field_validator

from pagedq.request_rules import MAX_JSON_DEPTH, ValidInput, json_too_deep


class _Strict(ValidInput):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(None, description="The arguments' JSON schema.")
    strict: bool | None = Field(None, description="Accepted; forced calls (required, named) follow the schema either way.")


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr = Field(description="The arguments: a JSON object's text.")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        # The body's depth limit does not see into this text: 3,000 nested brackets raised a
        # RecursionError in json.loads, a 500.
        if json_too_deep(value):
            raise ValueError(f"nests deeper than {MAX_JSON_DEPTH} levels")
        try:
            if isinstance(json.loads(value), dict):
                return value
        except ValueError:
            pass
        raise ValueError("must be a JSON object's text")


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"]
    function: FunctionCall

    def template_dict(self) -> dict:
        """For the chat template, which (as in vLLM) gets the arguments as an object: templates
        write them with `| tojson`."""
        arguments = json.loads(self.function.arguments)
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}
