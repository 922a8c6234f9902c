from __future__ import annotations

import functools
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedq.sampling_params import SamplingParams
from pagedq.detokenizer import IncrementalDetokenizer

EOS = "<|endoftext|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Café au lait, naïve façade, über-größe.",
    "東京は日本の首都です。今日はいい天気ですね。我们喜欢学习中文。",
    "Emoji time 🎉🚀👍🏽 and flags 🇫🇷 with hearts ❤️ and more 😀😃😄.",
    "Stop words like END and ### appear here; the end is near. Ünïcödé ñ ø å.",
]
# Characters of one to four UTF-8 bytes, so that tokens often split a character.
ALPHABET = list("abcdeENDX #.\n") + ["é", "ü", "ñ", "中", "日", "本", "🎉", "🚀", "😀", "❤", "🏽"]
REPLACEMENT = "\ufffd"


@functools.cache
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk_sizes: list[int]):
    """Feed token_ids in chunks; return (stop string, output_text after each update)."""
    snapshots = []
    sizes = itertools.cycle(chunk_sizes or [1])
    position = 0
    while position < len(token_ids):
        size = next(sizes)
        stop = detok.update(token_ids[position : position + size])
        position += size
        snapshots.append(detok.output_text)
        if stop is not None:
            return stop, snapshots
    return None, snapshots


def assert_grows_by_appending(snapshots: list[str], final: str) -> None:
    for earlier, later in zip(snapshots, snapshots[1:] + [final]):
        assert later.startswith(earlier)


texts = st.text(alphabet=ALPHABET, max_size=30)
chunkings = st.lists(st.integers(1, 4), max_size=5)
hypothesis_settings = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@hypothesis_settings
@given(
    prompt=texts,
    output_ids=st.lists(st.integers(0, 399), max_size=40),
    chunk_sizes=chunkings,
    skip_special_tokens=st.booleans(),
)
def test_random_token_stream_equals_full_decode(prompt, output_ids, chunk_sizes, skip_special_tokens):
    tok = byte_level_tokenizer()
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), params)
    stop, snapshots = stream(detok, output_ids, chunk_sizes)
    assert stop is None
    # A trailing U+FFFD may be half a character: it waits for the next token.
    assert not any(s.endswith(REPLACEMENT) for s in snapshots)
    detok.finish()
    expected = tok.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert detok.output_text == expected
    assert_grows_by_appending(snapshots, expected)


@hypothesis_settings
@given(text=texts, chunk_sizes=chunkings)
def test_valid_text_never_shows_a_replacement_character(text, chunk_sizes):
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("Hi "), SamplingParams())
    _, snapshots = stream(detok, tok.encode(text), chunk_sizes)
    assert not any(REPLACEMENT in s for s in snapshots)
    assert (snapshots or [""])[-1] == text
    detok.finish()
    assert detok.output_text == text


def test_split_character_is_shown_only_when_complete():
    tok = byte_level_tokenizer()
    ids = tok.encode("a🎉b")
    pieces = [tok.decode([i]) for i in ids]
    assert any(REPLACEMENT in p for p in pieces), "the emoji must span tokens for this test to mean anything"
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    _, snapshots = stream(detok, ids, [1])
    assert set(snapshots) <= {"a", "a🎉", "a🎉b"}
    assert snapshots[-1] == "a🎉b"


@hypothesis_settings
@given(
    before=texts,
    after=texts,
    stop=st.sampled_from(["END", "中🎉", "##", "\n\n"]),
    chunk_sizes=chunkings,
    include=st.booleans(),
)
def test_stop_string_cuts_text_wherever_tokens_split_it(before, after, stop, chunk_sizes, include):
    tok = byte_level_tokenizer()
    full = before + stop + after
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"), params)
    found, snapshots = stream(detok, tok.encode(full), chunk_sizes)
    assert found == stop
    index = full.find(stop)
    expected = full[: index + len(stop)] if include else full[:index]
    assert detok.output_text == expected
    # Streamed text never showed anything the stop string later cut.
    assert_grows_by_appending(snapshots, expected)
    with pytest.raises(RuntimeError):
        detok.update([0])


def test_stop_string_spanning_tokens_is_found():
    tok = byte_level_tokenizer()
    ids = tok.encode("xx 中🎉 yy")
    assert not any("中🎉" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop="中🎉"))
    assert stream(detok, ids, [1])[0] == "中🎉"
    assert detok.output_text == "xx "


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_stop_string_that_ends_first_wins_whatever_the_chunking(chunk):
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["ENDX", "D"]))
    assert stream(detok, tok.encode("aENDXb"), [chunk])[0] == "D"
    assert detok.output_text == "aEN"


def test_possible_stop_prefix_is_held_back_until_finish():
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["END", "##"]))
    assert stream(detok, tok.encode("hello EN"), [1])[0] is None
    assert detok.output_text == "hello "  # len("END") - 1 characters wait
    detok.finish()
    assert detok.output_text == "hello EN"


def test_without_stop_strings_nothing_is_held_back():
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    stream(detok, tok.encode("hello EN"), [1])
    assert detok.output_text == "hello EN"


def test_stop_strings_are_ignored_before_min_tokens():
    tok = byte_level_tokenizer()
    ids = tok.encode("END xyz END q")
    first_end = next(k for k in range(1, len(ids) + 1) if "END" in tok.decode(ids[:k]))
    params = SamplingParams(stop="END", min_tokens=first_end + 1)
    detok = IncrementalDetokenizer(tok, [], params)
    assert stream(detok, ids, [1])[0] == "END"
    assert detok.output_text == "END xyz "


def test_decode_token_shows_special_tokens():
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=True))
    assert detok.decode_token(tok.convert_tokens_to_ids(EOS)) == EOS
    assert detok.decode_token(tok.encode("a")[0]) == "a"


class DecodeRecorder:
    """Wraps a tokenizer and records how many ids each decode call received."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_each_update_decodes_only_a_short_window():
    tok = byte_level_tokenizer()
    text = "The quick brown fox jumps over the lazy dog. " * 10
    ids = tok.encode(text)
    assert len(ids) > 100
    recorder = DecodeRecorder(tok)
    detok = IncrementalDetokenizer(recorder, tok.encode("a prompt of some length"), SamplingParams())
    stream(detok, ids, [1])
    assert detok.output_text == text
    assert max(recorder.lengths) <= 7  # five prompt tokens of context plus the window


def test_first_token_keeps_its_leading_space_with_sentencepiece_style_decoder():
    # Metaspace decoders drop the text's first leading space; decoding the output in the
    # prompt's context (as vLLM does) keeps the space between prompt and output.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    assert tok.decode([2, 3]) == "world!"
    detok = IncrementalDetokenizer(tok, [1], SamplingParams())
    stream(detok, [2, 3], [1])
    assert detok.output_text == " world!"


def test_prompt_ending_inside_a_character_lends_the_output_nothing():
    tok = byte_level_tokenizer()
    ids = tok.encode("a🎉")
    assert REPLACEMENT in tok.decode(ids[:-1])
    output = [ids[-1], *tok.encode("b")]
    detok = IncrementalDetokenizer(tok, ids[:-1], SamplingParams())
    stream(detok, output, [1])
    detok.finish()
    assert detok.output_text == tok.decode(output)
