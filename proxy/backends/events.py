"""What one stream event carries, as the relay needs to know it (shared by every wire format)."""

from __future__ import annotations

import enum


class EventKind(enum.Enum):
    """What one stream event carries, as far as timing and usage go."""

    OTHER = 0  # role-only deltas, empty chunks, unknown shapes
    TOKEN = 1  # a token of any kind (reasoning included)
    VISIBLE = 2  # a token the user sees: content or tool calls, not reasoning
    USAGE_ONLY = 3  # the final usage event (``choices: []``)
    ERROR = 4  # an ``{"error": …}`` event
