"""The api's prompt checks cost what the model's limit allows, never what a client sends:
a text too long for any prompt is refused by its length, a long one by the tokens of its
beginning, tokenizing one long prompt holds one tokenizer copy, never every other
client's submit, and a short prompt tokenized on the event loop never waits for the
threads' copies."""

from __future__ import annotations

import asyncio
import threading

import pytest

from api.prompts import INLINE_PROMPT_CHARS, PromptChecker, tokenized_inline
from pagedq.model_info import PromptTooLong
from pagedq.settings import Settings


@pytest.fixture(scope="module")
def checker(tiny_model_dir):
    return PromptChecker(Settings(model=str(tiny_model_dir("llama"))))


class Recording:
    """A tokenizer that records the length of every text it encodes."""

    def __init__(self, tokenizer, lengths: list[int]):
        self.tokenizer, self.lengths = tokenizer, lengths

    def encode(self, text: str, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


def recorded(checker: PromptChecker) -> list[int]:
    """Swap every pooled copy for a recording one; the lengths they encode."""
    lengths: list[int] = []
    copies = [checker._tokenizers.get() for _ in range(4)]
    for copy in copies:
        checker._tokenizers.put(Recording(copy, lengths))
    return lengths


def test_a_text_too_long_for_any_prompt_is_refused_unread(checker):
    lengths = recorded(checker)
    with pytest.raises(PromptTooLong, match="characters"):
        checker._encode("a" * (checker.max_prompt_chars + 1))
    assert lengths == []


def test_a_long_prompt_is_refused_by_the_tokens_of_its_beginning(checker):
    lengths = recorded(checker)
    text = ("lorem ipsum dolor sit amet " * checker.max_prompt_chars)[: checker.max_prompt_chars]
    with pytest.raises(PromptTooLong, match="first"):
        checker._encode(text)
    # Only its beginning was tokenized: a few characters per token the limit allows.
    assert lengths == [8 * checker.token_limit] and lengths[0] < len(text)
    # One that fits is tokenized whole, as before.
    assert checker._encode("lorem ipsum") == checker.tokenizer.encode("lorem ipsum")


def test_a_chat_whose_template_renders_too_much_is_refused_before_it_is_tokenized(checker):
    """The tiny model's template renders eos_token after every message, and
    chat_template_kwargs may set it: 80 KB of it over 1,500 messages rendered a prompt whose
    tokenizing took the api's memory whole. Variables that may render per message past a
    prompt's length are refused unrendered, and a rendered prompt past it untokenized; a
    chat that fits gives what apply_chat_template gives."""
    limit = checker.max_prompt_chars
    lengths = recorded(checker)
    with pytest.raises(PromptTooLong, match="chat_template_kwargs"):
        checker.chat_token_ids([{"role": "user", "content": ""}] * 1500, template_kwargs={"eos_token": "ab " * 10_000})
    half = [{"role": "user", "content": "x" * (limit // 2 - 10)}] * 2
    with pytest.raises(PromptTooLong, match="messages"):
        checker.chat_token_ids(half, template_kwargs={"eos_token": "y" * (limit // 4)})
    assert lengths == []
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "yes"}]
    expected = checker.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert checker.chat_token_ids(messages) == list(expected["input_ids"] if hasattr(expected, "keys") else expected)


def test_one_prompt_being_tokenized_holds_one_copy_only(checker):
    borrowed = threading.Barrier(4)
    release = threading.Event()

    def long_tokenization() -> None:
        with checker.borrowed():
            borrowed.wait(10)
            release.wait(30)

    others = [threading.Thread(target=long_tokenization) for _ in range(3)]
    for thread in others:
        thread.start()
    try:
        borrowed.wait(10)  # three copies are busy
        result: list = []
        short = threading.Thread(target=lambda: result.append(checker._encode("hello there")))
        short.start()
        short.join(10)
        # The fourth copy serves it while the others are held.
        assert result == [checker.tokenizer.encode("hello there")]
    finally:
        release.set()
        for thread in others:
            thread.join(10)


def test_a_short_prompt_on_the_event_loop_never_waits_for_the_threads_copies(checker):
    """Short prompts are tokenized on the loop (token ids are only checked there): while
    every pooled copy is busy with long prompts in the api's threads, the loop's own copy
    serves them, and the loop, every client's, never blocks on the pool."""
    assert tokenized_inline(["a" * INLINE_PROMPT_CHARS, list(range(100_000))])
    assert not tokenized_inline(["a" * INLINE_PROMPT_CHARS, "b"])
    held = [checker._tokenizers.get() for _ in range(4)]  # four long tokenizations in the threads
    try:
        result: list = []

        async def on_the_loop() -> None:
            result.append(checker._encode("hello there"))

        loop = threading.Thread(target=lambda: asyncio.run(on_the_loop()))
        loop.start()
        loop.join(10)
        assert result == [checker.tokenizer.encode("hello there")]
    finally:
        for copy in held:
            checker._tokenizers.put(copy)


def test_the_servers_json_whitespace_setting_fills_what_a_request_left_out(tiny_model_dir):
    """vLLM's --structured-outputs-config.disable_any_whitespace: the server's default for JSON
    shapes; a request that says otherwise keeps its own, and other shapes are untouched."""
    from pagedq.protocol import GenerateRequest

    compact = PromptChecker(Settings(model=str(tiny_model_dir("llama")), structured_outputs_disable_any_whitespace=True))
    plain = PromptChecker(Settings(model=str(tiny_model_dir("llama"))))

    def shaped(checker, shape):
        return checker.with_generation_defaults(GenerateRequest(prompt="a", structured_outputs=shape)).structured_outputs

    assert shaped(compact, {"json": {"type": "object"}}).disable_any_whitespace is True
    assert shaped(compact, {"json_object": True}).disable_any_whitespace is True
    assert shaped(compact, {"json_object": True, "disable_any_whitespace": False}).disable_any_whitespace is False
    assert shaped(compact, {"regex": "a+"}).disable_any_whitespace is False
    assert shaped(plain, {"json": {"type": "object"}}).disable_any_whitespace is False
