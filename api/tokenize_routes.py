"""vLLM's utility routes: POST /tokenize (a prompt, or chat messages through the chat
template, to token ids), POST /detokenize (token ids to text) and GET /version.

Request and response shapes are vLLM's, so tools written for `vllm serve` (benchmarks
that count tokens, clients that check a prompt's length before sending it) work
unchanged. Nothing is queued: the api's own tokenizer answers.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator

from api.auth import authenticate
from api.errors import bad_request
from api.openai_schemas import ChatMessage
from api.prompts import PromptChecker
from api.threads import blocking
from pagedq.request_rules import ValidInput

router = APIRouter(tags=["Tokenizer"])
_AUTH = [Depends(authenticate)]


class TokenizeRequest(ValidInput):
    """vLLM's two tokenize requests (a prompt, or chat messages) in one body: whichever is given."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = Field(None, description="The served model; left out, that one.")
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="Instead of prompt: a conversation.")
    add_generation_prompt: bool = Field(True, description="With messages: end with the assistant's turn, as chat does.")
    add_special_tokens: bool | None = Field(
        None, description="Add the tokenizer's special tokens (e.g. BOS) to a prompt (the default, as vLLM's); "
        "messages get those their chat template writes."
    )
    return_token_strs: bool = Field(False, description="Also return each token as the vocabulary spells it.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="With messages: variables for the chat template.")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give a prompt or messages (one of them)")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens: not with messages (their chat template writes the special tokens)")
        return self


class TokenizeResponse(BaseModel):
    count: int = Field(description="How many tokens.")
    max_model_len: int = Field(description="The model's context length: prompt and output together.")
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(ValidInput):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = Field(None, description="The served model; left out, that one.")
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="The tokens' text.")


class VersionResponse(BaseModel):
    version: str = Field(description="pagedq's version.")


@router.post("/tokenize", response_model=TokenizeResponse, dependencies=_AUTH)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """The token ids the served model reads for a prompt, or for chat messages rendered
    through its chat template (as POST /v1/chat/completions renders them)."""
    request.app.state.openai.check_model(body.model)
    checker: PromptChecker = request.app.state.prompts

    def run() -> TokenizeResponse:
        try:
            if body.messages is not None:
                messages = [message.template_dict() for message in body.messages]
                ids = checker.chat_token_ids(messages, body.add_generation_prompt, body.chat_template_kwargs)
            else:
                ids = checker.tokenize(body.prompt, body.add_special_tokens is not False)
        except ValueError as exc:
            raise bad_request(exc) from None
        return TokenizeResponse(count=len(ids), max_model_len=checker.max_model_len, tokens=ids,
                                token_strs=checker.token_strings(ids) if body.return_token_strs else None)

    return await blocking(request, run)


@router.post("/detokenize", response_model=DetokenizeResponse, dependencies=_AUTH)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    request.app.state.openai.check_model(body.model)
    checker: PromptChecker = request.app.state.prompts
    try:
        return DetokenizeResponse(prompt=await blocking(request, checker.detokenize, body.tokens))
    except ValueError as exc:
        raise bad_request(exc) from None


@router.get("/version", response_model=VersionResponse)
async def server_version() -> VersionResponse:
    """As vLLM's GET /version: open to anyone, like GET /health."""
    return VersionResponse(version=version("pagedq"))
