"""The cache model of a server with slots, under the name the scheduler uses.

A server with slots keeps one prompt cache per slot (and may keep a RAM cache of prompts it
saved); the scheduler places requests with a model of those rules. Today one server has slots,
and its rules live with its dialect (``proxy.backends.llamacpp_cache``, its prompt states and
their tokens in ``proxy.backends.llamacpp_tokens``); this module is the
server-neutral door to them, so code outside ``proxy/backends/`` never names the server.
"""

from proxy.backends.llamacpp_cache import (
    SOURCE_NONE,
    SOURCE_RAM,
    SOURCE_SLOT,
    Pick,
    RamCache,
    ServerRules,
    SlotView,
    launch,
    pick,
    probe_of,
    restorable,
)
from proxy.backends.llamacpp_tokens import CachedPrompt, PromptQuery, Shared, TokenCounter

__all__ = [
    "SOURCE_NONE",
    "SOURCE_RAM",
    "SOURCE_SLOT",
    "CachedPrompt",
    "Pick",
    "PromptQuery",
    "RamCache",
    "ServerRules",
    "Shared",
    "SlotView",
    "TokenCounter",
    "launch",
    "pick",
    "probe_of",
    "restorable",
]
