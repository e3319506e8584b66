"""The canonicalizer: rewrites requests so that their stable part is byte-identical every time.

Applications build the same request slightly differently each time: a timestamp in the system
prompt, tools in another order, JSON keys shuffled by a serializer, a request id near the top.
The backend's prefix cache stops at the first differing byte, so each of these throws away
everything after it. The rules here undo those differences without changing what the request
means, so the backend's cache hits.

    stable_json          tool schemas, tool order and tool-call arguments: the first form seen
    whitespace           line endings and line-end blanks in system prompts and tool docs: the
                         first spelling seen (proxy.canonical.learned)
    volatile_timestamps  dates and times in the stable segments move to a note (see relocation)
    volatile_uuids       UUIDs, likewise
    volatile_hex_ids     long hex ids, likewise
    custom_patterns      the user's own regexes, likewise
    volatile_learned     values no detector knows, learned from traffic (proxy.canonical.spans,
                         proxy.canonical.span_memory), likewise

Public surface: ``Canonicalizer``, ``CanonicalResult``, ``CanonicalConfig``, ``RuleConfig``,
``CustomPattern``, ``config_from_mapping``, ``RULE_NAMES``, ``Change``, ``Skip``.
"""

from proxy.canonical.config import (
    RULE_NAMES,
    CanonicalConfig,
    CustomPattern,
    RuleConfig,
    config_from_mapping,
)
from proxy.canonical.outcome import Change, Skip
from proxy.canonical.pipeline import Canonicalizer, CanonicalResult, request_kind

__all__ = [
    "RULE_NAMES",
    "CanonicalConfig",
    "CanonicalResult",
    "Canonicalizer",
    "Change",
    "CustomPattern",
    "RuleConfig",
    "Skip",
    "config_from_mapping",
    "request_kind",
]
