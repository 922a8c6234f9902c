from __future__ import annotations

import functools
import itertools
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedq.sampling_params import SamplingParams
from pagedq.front.detokenizer import IncrementalDetokenizer, ids_decoder

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


@hypothesis_settings
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=8),
    chunk_sizes=chunkings,
)
def test_of_many_overlapping_stop_strings_the_one_that_ends_first_cuts(text, stops, chunk_sizes):
    """Whatever the chunking, the text is cut at the stop string whose first occurrence ends
    first (the longest of those ending there), as a character-by-character reader meets it
    (only stop strings ending in new text are searched: the rest cannot end there)."""
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops))
    found, _ = stream(detok, tok.encode(text), chunk_sizes)
    firsts = [(text.find(stop) + len(stop), text.find(stop), stop) for stop in stops if stop in text]
    if not firsts:
        assert found is None
        return
    _, index, stop = min(firsts)
    assert (found, detok.output_text) == (stop, text[:index])


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


@functools.cache
def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2 / Mistral-v0.1 `tokenizer.json` layout: a BPE over "▁"-marked pieces with
    byte fallback, and a decoder that strips the decoded text's first space."""
    from tokenizers import normalizers

    pieces = ["▁", "▁Hello", "▁world", "Hello", "world", "▁the", "the", "▁a", "a", "b", "▁b", "!", ",", ".",
              "é", "▁é", "中", "▁中", "▁\n", "\n", "▁1", "1"]
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = {token: index for index, token in enumerate(specials + byte_tokens + pieces)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_space_after_a_skipped_special_token_is_kept():
    # The regression: after "</s>" the window held only that token, which decodes to ""
    # when skipped, and the decoder's strip then ate "▁world"'s space.
    tok = sentencepiece_tokenizer()
    hello, world, eos = tok.convert_tokens_to_ids(["▁Hello", "▁world", "</s>"])
    assert tok.decode([hello, eos, world], skip_special_tokens=True) == "Hello world"
    detok = IncrementalDetokenizer(tok, [hello], SamplingParams())
    stream(detok, [eos, world], [1])
    assert detok.output_text == " world"


def _byte_fallback_ids(char: str) -> list[int]:
    return sentencepiece_tokenizer().convert_tokens_to_ids([f"<0x{b:02X}>" for b in char.encode()])


# Pieces and specials, or a character spelled in byte-fallback tokens (whole, so that the
# full decode never turns earlier bytes into U+FFFD after the fact).
_piece_ids = [i for token, i in sentencepiece_tokenizer().get_vocab().items() if not token.startswith("<0x")]
sentencepiece_ids = st.lists(
    st.one_of(
        st.sampled_from(_piece_ids).map(lambda i: [i]),
        st.sampled_from(sentencepiece_tokenizer().all_special_ids).map(lambda i: [i]),
        st.sampled_from(["é", "中", "🎉", "x"]).map(_byte_fallback_ids),
    ),
    max_size=12,
).map(lambda units: [i for unit in units for i in unit])


@hypothesis_settings
@given(
    prompt_ids=sentencepiece_ids,
    output_ids=sentencepiece_ids,
    chunk_sizes=chunkings,
    skip_special_tokens=st.booleans(),
)
def test_sentencepiece_stream_equals_full_decode_in_the_prompts_context(
    prompt_ids, output_ids, chunk_sizes, skip_special_tokens
):
    tok = sentencepiece_tokenizer()
    prompt_text = tok.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    full_text = tok.decode(prompt_ids + output_ids, skip_special_tokens=skip_special_tokens)
    # A prompt ending inside a character lends the output its bytes (tested above).
    assume(REPLACEMENT not in prompt_text and full_text.startswith(prompt_text))
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(skip_special_tokens=skip_special_tokens))
    _, snapshots = stream(detok, output_ids, chunk_sizes)
    detok.finish()
    expected = full_text[len(prompt_text):]
    assert detok.output_text == expected
    assert_grows_by_appending(snapshots, expected)


@hypothesis_settings
@given(
    prompt_ids=sentencepiece_ids,
    output_ids=sentencepiece_ids,
    skip_special_tokens=st.booleans(),
    byte_level=st.booleans(),
)
def test_tokens_decoded_at_once_give_the_text_they_give_one_at_a_time(prompt_ids, output_ids, skip_special_tokens,
                                                                     byte_level):
    """Without stop strings tokens wait for a read; one read at the end must show what
    reading after every token shows."""
    tok = byte_level_tokenizer() if byte_level else sentencepiece_tokenizer()
    if byte_level:
        prompt_ids, output_ids = [t % 400 for t in prompt_ids], [t % 400 for t in output_ids]
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    one_at_a_time = IncrementalDetokenizer(tok, prompt_ids, params)
    _, snapshots = stream(one_at_a_time, output_ids, [1])
    one_at_a_time.finish()
    at_once = IncrementalDetokenizer(tok, prompt_ids, params)
    for token in output_ids:
        at_once.update([token])
    at_once.finish()
    assert at_once.output_text == one_at_a_time.output_text


def test_without_stop_strings_tokens_are_decoded_when_read():
    tok = byte_level_tokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 10)
    recorder = DecodeRecorder(tok)
    detok = IncrementalDetokenizer(recorder, tok.encode("a prompt"), SamplingParams())
    calls_after_init = len(recorder.lengths)
    for token in ids:
        detok.update([token])
    assert len(recorder.lengths) == calls_after_init  # nothing decoded yet
    assert detok.output_text == tok.decode(ids)
    assert len(recorder.lengths) - calls_after_init <= 2


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_stop_token_text_is_left_out_unless_include_stop_str_in_output(include, skip_special_tokens):
    """vLLM V1: a sequence ended by eos or a stop_token_ids token does not detokenize that
    token unless include_stop_str_in_output (skip_special_tokens=False shows it then)."""
    tok = byte_level_tokenizer()
    eos = tok.convert_tokens_to_ids(EOS)
    params = SamplingParams(include_stop_str_in_output=include, skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tok, [], params)
    assert detok.update(tok.encode("ab")) is None
    assert detok.update([eos], stop_terminated=True) is None
    detok.finish()
    assert detok.output_text == "ab" + (EOS if include and not skip_special_tokens else "")


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_may_end_in_a_kept_stop_tokens_text(include):
    """vLLM V1 looks for stop strings in the text this update decoded, the stop token's
    own text included when include_stop_str_in_output keeps it."""
    tok = byte_level_tokenizer()
    eos = tok.convert_tokens_to_ids(EOS)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop="endoftext", include_stop_str_in_output=include,
                                                           skip_special_tokens=False))
    assert detok.update(tok.encode("ab")) is None
    assert detok.update([eos], stop_terminated=True) == ("endoftext" if include else None)
    detok.finish()
    assert detok.output_text == ("ab<|endoftext" if include else "ab")


def test_stop_string_completed_by_the_min_tokens_th_token_does_not_count():
    """vLLM V1 (PR 22014): stop strings are looked for only once more than min_tokens
    tokens exist, and only where they end in text of the tokens after the first
    min_tokens. A stop string made by exactly min_tokens tokens is text like any other."""
    tok = byte_level_tokenizer()
    ids = tok.encode("xx END yy END zz")
    first_end = next(k for k in range(1, len(ids) + 1) if "END" in tok.decode(ids[:k]))
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop="END", min_tokens=first_end))
    assert stream(detok, ids, [1])[0] == "END"
    assert detok.output_text == "xx END yy "
    # Fed in one update, the same tokens give the same answer.
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop="END", min_tokens=first_end))
    assert detok.update(ids) == "END"
    assert detok.output_text == "xx END yy "


@pytest.mark.parametrize("spaces_between_special_tokens", [True, False])
def test_consecutive_special_tokens_show_as_their_content(spaces_between_special_tokens):
    """vLLM's fast detokenizer with spaces_between_special_tokens=False shows a special
    token that follows another as its raw content; with True (its default) it shows what
    the tokenizer decodes. Fast tokenizers decode added tokens as their content with no
    space between, so both settings give the same text, here and in vLLM."""
    tok = sentencepiece_tokenizer()
    hello, bos, eos, world = tok.convert_tokens_to_ids(["▁Hello", "<s>", "</s>", "▁world"])
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces_between_special_tokens)
    detok = IncrementalDetokenizer(tok, [hello], params)
    stream(detok, [bos, eos, eos, world], [1])
    assert detok.output_text == "<s></s></s> world"


@pytest.mark.parametrize("skip_special_tokens", [False, True])
@pytest.mark.parametrize("make_tokenizer", [byte_level_tokenizer, sentencepiece_tokenizer])
def test_ids_decoder_skips_transformers_but_not_its_result(make_tokenizer, skip_special_tokens, monkeypatch):
    tok = make_tokenizer()
    rng = random.Random(0)
    samples = [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))] for _ in range(300)]
    want = [tok.decode(ids, skip_special_tokens=skip_special_tokens) for ids in samples]
    decode = ids_decoder(tok)

    def through_transformers(*args, **kwargs):
        raise AssertionError("the tokenizers library should have been called directly")

    monkeypatch.setattr(tok, "decode", through_transformers)
    assert [decode(ids, skip_special_tokens) for ids in samples] == want


def test_ids_decoder_leaves_space_clean_up_to_transformers(monkeypatch):
    tok = byte_level_tokenizer()
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True)
    calls = []
    monkeypatch.setattr(tok, "decode", lambda ids, skip_special_tokens: calls.append(ids) or "cleaned")
    assert ids_decoder(tok)([5, 6], False) == "cleaned" and calls == [[5, 6]]
