"""What can go wrong between the proxy and a backend, as ``proxy.wire`` reports it."""

from __future__ import annotations


class WireError(Exception):
    """The exchange with the backend failed."""


class WireConnectError(WireError):
    """No connection to the backend could be made (refused, unresolvable, TLS)."""


class WireClosed(WireError):
    """The backend closed (or reset) the connection before the answer ended."""

    def __init__(self, message: str, *, before_answer: bool) -> None:
        super().__init__(message)
        self.before_answer = before_answer  # nothing of an answer had arrived


class WireBadAnswer(WireError):
    """The backend's bytes are not an HTTP/1.1 answer this client reads."""


class WireTimeout(TimeoutError):
    """No byte came from the backend for the idle limit."""


class WireConnectTimeout(TimeoutError):
    """Connecting to the backend took longer than the connect limit."""
