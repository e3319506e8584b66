"""``value``: the dataclass decorator of the small values built on the request path.

They are values (hashable and equal by their fields, never changed once built), as
``@dataclass(frozen=True)`` would make them, but not frozen: a frozen dataclass's ``__init__``
sets each field through ``object.__setattr__``, about three times the cost of a plain one, and
a request builds dozens of these (a slot choice's picks and matches, the fingerprint, the view,
the routing candidates). Nothing assigns to their fields.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(field_specifiers=(dataclasses.field,))
def value(cls: type[T]) -> type[T]:
    """``@dataclass(slots=True)``, hashed by its fields (see the module docstring)."""
    return dataclasses.dataclass(slots=True, unsafe_hash=True)(cls)
