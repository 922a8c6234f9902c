"""pagedq.request_rules: the text rule looks into every list that can hold text, however
it is mixed, and passes lists that cannot (token ids) without a look at each item."""

from __future__ import annotations

import pytest

from pagedq.request_rules import unencodable_text


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
