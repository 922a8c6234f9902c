"""The map and reduce prompts as token ids: a template's tokens before and after `{text}`
(through the chat template for chat models) around the text's own tokens, so a prompt's
length is known exactly and every chunk's prompt starts with the same tokens (the prefix
cache shares them)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedq.summaries import TEXT_FIELD

# Stands for the text while the chat template is rendered; split on afterwards.
_PLACEHOLDER = "\uE000pagedq-text\uE000"
# Between partial summaries in a reduce prompt.
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Frame:
    prefix: list[int]
    suffix: list[int]

    def around(self, text_ids: list[int]) -> list[int]:
        return [*self.prefix, *text_ids, *self.suffix]

    @property
    def overhead(self) -> int:
        return len(self.prefix) + len(self.suffix)


def frame(tokenizer, template: str, chat: bool) -> Frame:
    """The tokens a template puts around its text. ValueError for a chat model without a
    chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat: this model's tokenizer has no chat template; summarize without chat")
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": template.replace(TEXT_FIELD, _PLACEHOLDER)}],
            add_generation_prompt=True, tokenize=False,
        )
        before, after = rendered.split(_PLACEHOLDER)
        # The rendered template spells out its special tokens (as apply_chat_template's tokenize=True reads them).
        return Frame(tokenizer.encode(before, add_special_tokens=False), tokenizer.encode(after, add_special_tokens=False))
    before, after = template.split(TEXT_FIELD)
    # A plain prompt starts as any prompt the api tokenizes does (with the tokenizer's BOS, if it adds one).
    return Frame(tokenizer.encode(before), tokenizer.encode(after, add_special_tokens=False))
