"""Miss attribution over logs: the records' uncached prompt tokens by cause, and what to do.

The proxy attributes every request's uncached prompt tokens to a cause (``proxy.attribution``;
the record's ``miss_*`` fields). Over a log this adds them up, with the dry-run rules behind
the breakers and the reasons behind routing, and gives the fix each cause calls for: a rule to
turn on, a routing knob, capacity to add, a placement.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.records import record_key

CAUSES = ("new", "breaker", "routing", "evicted", "unexplained")
KEYS = {cause: record_key(f"miss_{cause}_tokens") for cause in CAUSES}
K_RULES = record_key("miss_breaker_rules")
K_WHY = record_key("miss_routing_why")

_WHY_FIX = {
    "load_gate": "the load gate sent them away from the holder: raise --load-gate-ratio or "
    "--load-gate-slack, or add capacity where the popular prefixes live",
    "health": "the holder was ejected: see why it failed its health checks",
    "round_robin": "round-robin ignores where prompts are cached: --policy prefix-affinity",
    "least_loaded": "least-loaded ignores where prompts are cached: --policy prefix-affinity",
    "min_affinity": "the holder's match was not past the traffic-shared depth: lower "
    "--min-affinity-blocks",
    "affinity_key": "the client's conversation key names another replica: send one key per "
    "conversation (prompt_cache_key), not per request",
    "retry": "the holder failed before answering and the request was retried elsewhere",
    "slot": "the slot holding the prefix was busy: more slots (-np) or slot fan-out",
    "stale": "the index said another replica held more than the router saw: a shared store "
    "(--redis-url) for every proxy",
}


@dataclass(slots=True)
class MissTotals:
    """The uncached prompt tokens of the attributed records, by cause."""

    requests: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    breaker_rules: Counter[str] = field(default_factory=Counter)
    routing_why: Counter[str] = field(default_factory=Counter)

    def add(self, get: Callable[[str], Any]) -> None:
        """One record (its ``dict.get``); records without attribution are not counted."""
        if type(get(KEYS["new"])) is not int:
            return
        self.requests += 1
        tokens = self.tokens
        for cause, key in KEYS.items():
            n = get(key)
            if type(n) is int and n > 0:
                tokens[cause] += n
        breaker = get(KEYS["breaker"])
        rules = get(K_RULES)
        if type(breaker) is int and breaker > 0 and isinstance(rules, list):
            for rule in rules:
                if type(rule) is str:
                    self.breaker_rules[rule] += breaker
        routing, why = get(KEYS["routing"]), get(K_WHY)
        if type(routing) is int and routing > 0 and type(why) is str:
            self.routing_why[why] += routing

    @property
    def uncached(self) -> int:
        return sum(self.tokens.values())

    def share(self, cause: str) -> float | None:
        total = self.uncached
        return self.tokens[cause] / total if total else None

    def fixes(self) -> dict[str, str]:
        """The recommended fix per cause that has tokens."""
        out: dict[str, str] = {}
        t = self.tokens
        if t["breaker"]:
            rules = ", ".join(r for r, _ in self.breaker_rules.most_common()) or "the rules"
            out["breaker"] = (
                f"turn on {rules} (out of dry-run): the canonicalizer makes these spans stable"
            )
        if t["routing"]:
            whys = [w for w, _ in self.routing_why.most_common()]
            out["routing"] = "; ".join(_WHY_FIX.get(w, w) for w in whys) or "see routing"
        if t["evicted"]:
            out["evicted"] = (
                "the replicas' caches lose prompts they held: add capacity (slots, KV cache or "
                "--cache-ram memory, or replicas), place long-lived prefixes on a replica of "
                "their own; on llama.cpp, --slot-prompt-similarity 0 lets the server restore a "
                "conversation from its RAM cache instead of overwriting a slot"
            )
        if t["unexplained"]:
            out["unexplained"] = (
                "the prefix index did not answer (store degraded) or the backend served a little "
                "less than predicted; nothing to tune unless it grows"
            )
        if t["new"]:
            out["new"] = "nothing earlier shared these tokens: no setting would have cached them"
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "uncached_tokens": self.uncached,
            "tokens": dict(self.tokens),
            "shares": {c: self.share(c) for c in CAUSES},
            "breaker_rules": dict(self.breaker_rules),
            "routing_why": dict(self.routing_why),
            "fixes": self.fixes(),
        }
