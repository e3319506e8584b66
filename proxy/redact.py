"""Redaction of secrets in prompt text, applied before any prompt text is logged.

Prompt text reaches the logs only when the operator opts in (``--log-prompts``). Even then,
strings in the logged body pass through ``Redactor`` first: API keys and tokens of the common
providers, bearer tokens, private-key blocks, AWS access key ids, JSON web tokens and email
addresses are replaced by ``[REDACTED:<kind>]``. Operators add their own patterns with
``--redact-pattern`` (a Python regular expression; repeat the flag) or turn the defaults off with
``--no-redact-defaults``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_PATTERNS: Mapping[str, str] = {
    "private_key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----",
    "api_key": r"\b(?:sk|pk|rk)-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_\-]{16,}",
    "github_token": r"\bgh[pousr]_[A-Za-z0-9]{30,}",
    "slack_token": r"\bxox[abprs]-[A-Za-z0-9\-]{10,}",
    "aws_access_key": r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    "google_api_key": r"\bAIza[0-9A-Za-z_\-]{35}",
    "jwt": r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}",
    "bearer": r"(?i)\bbearer\s+[A-Za-z0-9._~+/\-]{16,}=*",
    "email": r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]+\.[A-Za-z]{2,}",
}


@dataclass(frozen=True, slots=True)
class Redactor:
    """Replaces every match of its patterns in every string of a JSON value."""

    patterns: tuple[tuple[str, re.Pattern[str]], ...]

    @classmethod
    def build(cls, extra: Iterable[str] = (), *, defaults: bool = True) -> Redactor:
        """The default patterns (unless turned off) plus the operator's own, compiled once.

        Raises ``re.error`` for an operator pattern that does not compile.
        """
        pats: list[tuple[str, re.Pattern[str]]] = []
        if defaults:
            pats += [(kind, re.compile(p)) for kind, p in DEFAULT_PATTERNS.items()]
        pats += [("custom", re.compile(p)) for p in extra if p]
        return cls(tuple(pats))

    def text(self, value: str) -> str:
        """``value`` with every match replaced by ``[REDACTED:<kind>]``."""
        for kind, pattern in self.patterns:
            value = pattern.sub(f"[REDACTED:{kind}]", value)
        return value

    def value(self, obj: Any) -> Any:
        """A copy of a JSON value with every string (keys included) redacted."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {self.text(str(k)): self.value(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self.value(v) for v in obj]
        return obj
