"""OpenAI's request bodies for /v1/completions and /v1/chat/completions: the fields pagedq
serves, vLLM's extra fields (`extra_body` in the openai client: sampling, structured
outputs, beam search, prompt truncation, token ids in the response), and clear errors
for what it does not (suffix, best_of, images). Chat's tools are api/tool_calls' (their
shapes in api/tool_calls/schemas.py).

OpenAI fields that change nothing about the generated text (`user`, `metadata`, `store`,
`service_tier`, `safety_identifier`, `prompt_cache_key`; for chat `parallel_tool_calls`,
which vLLM ignores too (a model may make several calls either way), and `reasoning_effort`,
which only reasoning models read) are accepted and ignored, as vLLM ignores them. Any
other unknown field is rejected rather than ignored: a request whose meaning would
silently change is worse than a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, model_validator

from api.tool_calls.schemas import Tool, ToolCall, ToolChoice
from pagedq.beam_search import LengthPenalty
from pagedq.protocol import GenerateRequest
from pagedq.request_rules import INT64_MAX, INT64_MIN, ValidInput, describe_invalid
from pagedq.structured_outputs_params import StructuredOutputsParams

# Fields passed on to SamplingParams under the same name.
_SAMPLING = (
    "n", "max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "include_stop_str_in_output", "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "bad_words",
    "prompt_logprobs",
)

# What vLLM's beam search reads of a request (BeamSearchParams); it ignores the other sampling fields.
_BEAM_SEARCH_READS = {"n", "max_tokens", "temperature", "ignore_eos", "include_stop_str_in_output",
                      "skip_special_tokens", "spaces_between_special_tokens"}
_IGNORED = "Accepted and ignored, as vLLM ignores it: it changes nothing about the generated text."


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # vLLM's defaults: no usage chunk unless include_usage is true.
    include_usage: bool | None = Field(False, description="A last chunk with no choices carries the request's usage.")
    continuous_usage_stats: bool | None = Field(
        False, description="vLLM's: with include_usage, every chunk carries the usage so far (its choice's tokens)."
    )


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr = Field(description="The schema's name (OpenAI requires it; it changes nothing here).")
    description: str | None = None
    # `schema` is OpenAI's name; on a pydantic model it would shadow BaseModel.schema.
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the output must follow.")
    strict: bool | None = Field(None, description="Accepted: the schema is always enforced, strict or not.")


class ResponseFormat(BaseModel):
    """OpenAI's response_format, which vLLM turns into structured outputs: json_object is
    any JSON object, json_schema a JSON schema, text no constraint."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise ValueError("response_format.json_schema: required with type json_schema")
        try:
            return StructuredOutputsParams(json=self.json_schema.schema_)
        except ValidationError as exc:
            # The client sent response_format: the error names it, not structured_outputs.
            reason = describe_invalid(exc).removeprefix("structured_outputs.json: ")
            raise ValueError(f"response_format.json_schema.schema: {reason}") from None


class _OpenAIRequest(ValidInput):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = Field(None, description="The served model (GET /v1/models); left out, that one.")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description=_IGNORED)
    metadata: dict[str, str] | None = Field(None, description=_IGNORED)
    store: bool | None = Field(None, description=_IGNORED)
    service_tier: str | None = Field(None, description=_IGNORED)
    safety_identifier: str | None = Field(None, description=_IGNORED)
    prompt_cache_key: str | None = Field(None, description=_IGNORED)
    response_format: ResponseFormat | None = None
    # vLLM's extras.
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="vLLM's: the output follows a JSON schema (json), a regex, a choice or a grammar."
    )
    allowed_token_ids: list[int] | None = None
    bad_words: list[StrictStr] | None = None
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="vLLM's: keep only the prompt's last N tokens (-1: as many as the context holds)."
    )
    use_beam_search: bool = Field(False, description="vLLM's: beam search with n beams; every beam is a choice, best first.")
    length_penalty: LengthPenalty = Field(1.0, description="vLLM's, for beam search: score = logprob / length ** length_penalty.")
    return_token_ids: bool = Field(
        False, description="vLLM's: the response holds prompt_token_ids and each choice's token_ids."
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="vLLM's: each prompt token's logprob and that many alternatives (not streamed)."
    )
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX, description="vLLM's request priority: lower runs earlier.")

    @model_validator(mode="after")
    def _supported(self) -> _OpenAIRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream=true")
        if self.response_format is not None and self.response_format.type != "text" and self.structured_outputs:
            raise ValueError("response_format: give response_format or structured_outputs, not both")
        if self.response_format is not None:
            self.response_format.structured_outputs()  # a schema that cannot compile is refused here
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens: -1 or at least 1 (0 would keep no prompt)")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream=true (as vLLM)")
        if self.return_token_ids and self.stream:
            raise ValueError("return_token_ids: not available with stream=true (streamed chunks carry text)")
        if self.use_beam_search:
            if self.stream:
                raise ValueError("use_beam_search: not available with stream=true (the beams are known at the end)")
            if self.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs: not available with use_beam_search (as on /generate)")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: usage in every chunk needs include_usage and continuous_usage_stats."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def _sampling(self, default_max_tokens: int | None, logprobs: int | None) -> dict:
        """GenerateRequest's fields but the prompt. Beam search (vLLM's use_beam_search) runs
        n beams and, as vLLM's, ignores the sampling fields it does not read; a temperature
        above 0 (vLLM samples its beams, pagedq's beam search does not) is refused by
        GenerateRequest, naming it."""
        fields = {name: getattr(self, name) for name in _SAMPLING if getattr(self, name) is not None}
        fields.setdefault("max_tokens", default_max_tokens)
        if logprobs is not None:
            fields["logprobs"] = logprobs
        if (response_format := self.response_format) is not None and response_format.type != "text":
            fields["structured_outputs"] = response_format.structured_outputs()
        elif self.structured_outputs is not None:
            fields["structured_outputs"] = self.structured_outputs
        if self.use_beam_search:
            fields = {name: value for name, value in fields.items() if name in _BEAM_SEARCH_READS}
            fields["beam_width"] = fields.pop("n", 1)
            if fields.get("temperature") == 0:
                del fields["temperature"]
            fields.update(use_beam_search=True, length_penalty=self.length_penalty)
        return {**fields, "priority": self.priority, "stream": self.stream}


# OpenAI's max_tokens for completions; without one, vLLM caps it at what the context leaves.
COMPLETION_MAX_TOKENS = 16


class CompletionRequest(_OpenAIRequest):
    prompt: StrictStr | list[int] | list[StrictStr] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="Each choice's text starts with its prompt (with logprobs: the prompt's too).")
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _supported_completion(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None and self.stream:
            raise ValueError("echo: with logprobs, only without stream (the prompt's logprobs come with the result)")
        if self.suffix is not None:
            raise ValueError("suffix: not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: not supported (one completion per request)")
        if not self.prompt:
            raise ValueError("prompt: must be non-empty")
        if any(not prompt for prompt in self.prompts):
            raise ValueError("prompt: every prompt must be non-empty")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: a string or a token-id list is one, a list of them several."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def generate_requests(self) -> list[GenerateRequest]:
        """The same requests as POST /generate takes, one per prompt. Without max_tokens, none
        (OpenAITranslator.prepare caps it once the prompt's length is known), but for beam search,
        which needs one."""
        sampling = self._sampling(COMPLETION_MAX_TOKENS if self.use_beam_search else None, self.logprobs)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            sampling["prompt_logprobs"] = self.logprobs  # vLLM's: echo's logprobs cover the prompt too
        return [
            GenerateRequest(**({"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}), **sampling)
            for p in self.prompts
        ]


class TextPart(ValidInput):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = Field(description="Only text parts: the served models read text.")
    text: StrictStr


class ChatMessage(ValidInput):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = Field(None, description="Null only in an assistant turn with tool_calls.")
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant turn's calls (an agent loop's history).")
    tool_call_id: StrictStr | None = Field(None, description="A tool turn's answer to this call.")

    @model_validator(mode="after")
    def _tool_turns(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only in an assistant message")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (null only in an assistant message with tool_calls)")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool_call_id: required in a tool message, and only there")
        return self

    def template_dict(self) -> dict:
        """The message as chat templates read it: text content ("" for none, as vLLM gives
        templates), tool calls with their arguments as objects, a tool turn's call id."""
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content or [])
        message = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = Field(True, description="vLLM's: end the prompt with the assistant's turn.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's: extra variables for the chat template (e.g. enable_thinking); "
        "apply_chat_template's own arguments (add_generation_prompt, tokenize, ...) are ignored, as vLLM ignores them."
    )
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = Field(None, description='"none", "auto" (the default with tools), "required", or '
                                           '{"type": "function", "function": {"name": ...}}.')
    parallel_tool_calls: bool | None = Field(None, description=_IGNORED + " (as vLLM: a model may make several calls)")
    reasoning_effort: str | None = Field(None, description=_IGNORED + " (The served models do not reason.)")

    @model_validator(mode="after")
    def _supported_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only with logprobs=true")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_completion_tokens: differs from max_tokens; give one")
            self.max_tokens = self.max_completion_tokens
        return self

    def generate_requests(self, prompt_token_ids: list[int], sampling_overrides: dict | None = None) -> list[GenerateRequest]:
        """The same request as POST /generate takes, for the templated prompt (no default
        bound on tokens, as OpenAI's chat: up to the context length); `sampling_overrides`:
        what the request's tools set (a ToolPlan's)."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        sampling = {**self._sampling(None, logprobs), **(sampling_overrides or {})}
        return [GenerateRequest(prompt_token_ids=prompt_token_ids, **sampling)]

