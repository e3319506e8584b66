"""``proxy.values.value``: values hashed and compared by their fields, built cheaply."""

from __future__ import annotations

import dataclasses

from proxy.backends.llamacpp_cache import Pick
from proxy.backends.llamacpp_tokens import PromptQuery, Shared
from proxy.values import value


@value
class Point:
    x: int
    tags: tuple[str, ...] = dataclasses.field(default=())


def test_a_value_is_equal_and_hashed_by_its_fields_and_keeps_no_dict() -> None:
    assert Point(1) == Point(1, ()) and Point(1) != Point(2)
    assert hash(Point(1, ("a",))) == hash(Point(1, ("a",)))
    assert {Point(1), Point(1), Point(2)} == {Point(1), Point(2)}
    assert not hasattr(Point(1), "__dict__")  # slots
    assert dataclasses.replace(Point(1), x=3) == Point(3)


def test_the_request_paths_values_stay_hashable_as_when_they_were_frozen() -> None:
    """The classes made values rather than frozen dataclasses hash as they did."""
    q = PromptQuery((1, 2), 10.0, 5.0)
    assert hash(q) == hash(PromptQuery((1, 2), 10.0, 5.0))
    assert len({Shared(3.0), Shared(3.0, key=7)}) == 2
    assert Pick(slot=1) == Pick(1) and hash(Pick(1)) == hash(Pick(slot=1))
