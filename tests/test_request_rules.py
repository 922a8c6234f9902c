"""pagedq.request_rules: the text rule looks into every list that can hold text, however
it is mixed, and passes lists that cannot (token ids) without a look at each item; a
request's integers are int64, which the engine takes at both ends."""

from __future__ import annotations

import pytest

from pagedq.request_rules import INT64_MAX, INT64_MIN, unencodable_text


class _Text(str):
    """A str subclass: text all the same."""


@pytest.mark.parametrize("value", [
    [1, 2, "a\ud800"], (3, ["\udfff"]), [1.5, None, True, {"k": "\ud800"}], [7, _Text("\ud800")], ["ok", "b\udc00"],
])
def test_a_lone_surrogate_anywhere_in_a_list_is_found(value):
    assert "lone UTF-16 surrogate" in unencodable_text(value)


@pytest.mark.parametrize("value", [[], [1, 2, 3], [1, 2.5, True, None], ["fine", 4, ("also fine",)]])
def test_lists_without_bad_text_pass(value):
    assert unencodable_text(value) is None


@pytest.mark.parametrize("field, value", [
    ("top_k", INT64_MAX + 1), ("min_tokens", INT64_MAX + 1), ("max_tokens", INT64_MAX + 1), ("priority", INT64_MAX + 1),
    ("priority", INT64_MIN - 1), ("seed", INT64_MIN - 1),
])
def test_an_integer_beyond_int64_is_refused_naming_its_field(field, value):
    """Past int64 a request's job failed in the engine (torch: "Overflow when unpacking long
    long"; msgspec: "can't serialize ints > 2**64 - 1"), a 500 on the OpenAI routes."""
    from pagedq.protocol import GenerateRequest

    with pytest.raises(ValueError, match=field):
        GenerateRequest.model_validate({"prompt": "a", field: value})


def test_the_engine_takes_int64_at_both_ends(tiny_model_dir):
    from pagedq import LLM, SamplingParams

    engine = LLM(tiny_model_dir(), dtype="float32", device="cpu").llm_engine
    engine.add_request("top", "a b", SamplingParams(max_tokens=3, top_k=INT64_MAX, temperature=1.0, seed=INT64_MIN),
                       priority=INT64_MAX)
    engine.add_request("first", "a b", SamplingParams(max_tokens=3, temperature=0), priority=INT64_MIN)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    assert {name: len(out.outputs[0].token_ids) for name, out in finished.items()} == {"top": 3, "first": 3}
