"""Canonicalizer settings: which rules run, in which mode, with which options.

Built once at start-up from the TOML file's ``[canonical]`` table by ``config_from_mapping``::

    [canonical]
    enabled = true
    dry_run = false                      # compute and report, forward the original
    note_placement = "last_suffix"       # last_suffix | user_suffix | user_prefix | system_suffix
    note_memory = true                   # restore earlier turns' notes; state only what changed
    note_memory_ttl_s = 86400            # how long a note is remembered (renewed on each turn)
    note_format = "{entries}"            # {entries}: one "[[date_1]] = <value>" line each

    [canonical.rules.stable_json]
    enabled = true
    dry_run = false
    sort_tools = true                    # order tools by function name
    sort_tool_properties = true          # sort property names inside tool parameter schemas
    sort_response_properties = false     # ... and inside response_format schemas
    tool_call_arguments = true           # canonical JSON for assistant tool-call arguments

    [canonical.rules.whitespace]
    raw_prompts = false                  # also normalise /v1/completions prompt strings

    [canonical.rules.volatile_timestamps]
    bare_times = false                   # "22:41" with neither seconds nor AM/PM
    bare_epochs = false                  # 10/13-digit epoch numbers with no keyword before them

    [canonical.rules.volatile_hex_ids]
    min_length = 16

    [canonical.rules.volatile_learned]   # values learned from traffic (proxy.canonical.spans)
    min_requests = 3                     # requests of the template the pattern must match
    min_values = 3                       # distinct values it must have seen there
    max_patterns = 64                    # learned patterns kept per namespace

    [[canonical.patterns]]               # the custom_patterns rule
    name = "request_id"
    regex = 'request id: (\\S+)'         # a group named "value", else group 1, else the match

Unknown rule names, unknown keys and values of the wrong type fail fast with ``ConfigError``.

Defaults. Every rule is on. The detectors that would misfire on ordinary text are options that
are off: a bare ``HH:MM`` is as often a ratio, a score or a Bible verse as a clock time, and a
bare ten-digit number is as often a phone number, an order number or a count as an epoch. Both
stay on the safe side: a value the detector misses only costs cache hits, a value it wrongly
moves costs the model a look-up in the note. ``volatile_learned`` wants three distinct values
by default, not two: a prompt edited once (a version bumped, a word changed) has shown two
values at one place without being a per-request value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from proxy.config import ConfigError

STABLE_JSON = "stable_json"
WHITESPACE = "whitespace"
VOLATILE_TIMESTAMPS = "volatile_timestamps"
VOLATILE_UUIDS = "volatile_uuids"
VOLATILE_HEX_IDS = "volatile_hex_ids"
CUSTOM_PATTERNS = "custom_patterns"
VOLATILE_LEARNED = "volatile_learned"

RULE_NAMES: tuple[str, ...] = (
    STABLE_JSON,
    WHITESPACE,
    VOLATILE_TIMESTAMPS,
    VOLATILE_UUIDS,
    VOLATILE_HEX_IDS,
    CUSTOM_PATTERNS,
    VOLATILE_LEARNED,
)
VOLATILE_RULES: tuple[str, ...] = RULE_NAMES[2:]

NotePlacement = Literal["user_prefix", "user_suffix", "last_suffix", "system_suffix"]
NOTE_PLACEMENTS: tuple[NotePlacement, ...] = (
    "user_prefix",
    "user_suffix",
    "last_suffix",
    "system_suffix",
)
DEFAULT_NOTE_FORMAT = "{entries}"

Option = bool | int

# Each rule's options with their defaults; the type of the default is the option's type.
RULE_OPTIONS: Mapping[str, Mapping[str, Option]] = MappingProxyType(
    {
        STABLE_JSON: MappingProxyType(
            {
                "sort_tools": True,
                "sort_tool_properties": True,
                "sort_response_properties": False,
                "tool_call_arguments": True,
            }
        ),
        WHITESPACE: MappingProxyType({"raw_prompts": False}),
        VOLATILE_TIMESTAMPS: MappingProxyType({"bare_times": False, "bare_epochs": False}),
        VOLATILE_UUIDS: MappingProxyType({}),
        VOLATILE_HEX_IDS: MappingProxyType({"min_length": 16}),
        CUSTOM_PATTERNS: MappingProxyType({}),
        VOLATILE_LEARNED: MappingProxyType(
            {"min_requests": 3, "min_values": 3, "max_patterns": 64}
        ),
    }
)
# The smallest value of each integer option (8 unless named here).
OPTION_MINIMUM: Mapping[str, int] = MappingProxyType(
    {"min_requests": 2, "min_values": 2, "max_patterns": 1}
)
_LABEL = re.compile(r"[a-z][a-z0-9_]*\Z")


@dataclass(frozen=True, slots=True)
class RuleConfig:
    """One rule's switch, mode and options (every option present, defaults filled in)."""

    enabled: bool = True
    dry_run: bool = False
    options: Mapping[str, Option] = field(default_factory=lambda: MappingProxyType({}))

    def flag(self, name: str) -> bool:
        """A boolean option."""
        return bool(self.options[name])

    def number(self, name: str) -> int:
        """An integer option."""
        return int(self.options[name])


@dataclass(frozen=True, slots=True)
class CustomPattern:
    """A user's volatile value: a name (the placeholder's label) and a regex.

    The value is the group named ``value`` if the regex has one, else group 1 if it has
    groups, else the whole match; the text around the value stays in the prompt.
    """

    name: str
    regex: str
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)
    group: int | str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _LABEL.match(self.name):
            raise ConfigError(
                f"canonical pattern name {self.name!r}: use lowercase letters, digits and _"
            )
        try:
            pattern = re.compile(self.regex)
        except re.error as exc:
            raise ConfigError(f"canonical pattern {self.name!r}: bad regex ({exc})") from exc
        if pattern.fullmatch(""):
            raise ConfigError(f"canonical pattern {self.name!r} matches the empty string")
        group: int | str = 0
        if "value" in pattern.groupindex:
            group = "value"
        elif pattern.groups:
            group = 1
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "group", group)


def default_rules() -> Mapping[str, RuleConfig]:
    """Every rule on, not in dry-run, with default options."""
    return MappingProxyType({name: RuleConfig(options=RULE_OPTIONS[name]) for name in RULE_NAMES})


@dataclass(frozen=True, slots=True)
class CanonicalConfig:
    """Everything the canonicalizer is configured with."""

    enabled: bool = True
    dry_run: bool = False
    rules: Mapping[str, RuleConfig] = field(default_factory=default_rules)
    custom_patterns: tuple[CustomPattern, ...] = ()
    note_placement: NotePlacement = "last_suffix"
    note_format: str = DEFAULT_NOTE_FORMAT
    note_memory: bool = True
    note_memory_ttl_s: float = 86_400.0

    def __post_init__(self) -> None:
        unknown = set(self.rules) - set(RULE_NAMES)
        if unknown:
            raise ConfigError(f"unknown canonical rule(s): {', '.join(sorted(unknown))}")
        # Fill in absent rules and options, so rules can read every option they know.
        filled = {}
        for name in RULE_NAMES:
            given = self.rules.get(name) or RuleConfig()
            options = MappingProxyType({**RULE_OPTIONS[name], **given.options})
            filled[name] = RuleConfig(given.enabled, given.dry_run, options)
        object.__setattr__(self, "rules", MappingProxyType(filled))
        if self.note_placement not in NOTE_PLACEMENTS:
            raise ConfigError(f"note_placement must be one of {', '.join(NOTE_PLACEMENTS)}")
        if "{entries}" not in self.note_format:
            raise ConfigError("note_format must contain {entries}")
        if self.note_placement == "system_suffix" and not (
            self.note_format.startswith("{entries}") or "\n{entries}" in self.note_format
        ):
            # In a system message the note's lines are recognised by their start, which keeps
            # the values in them from being detected again on the next pass.
            raise ConfigError("with system_suffix, {entries} must start a line of note_format")

    def rule(self, name: str) -> RuleConfig:
        """The settings of one rule."""
        return self.rules[name]


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, not {value!r}")
    return value


def _option(where: str, default: Option, value: Any) -> Option:
    if isinstance(default, bool):
        return _bool(where, value)
    least = OPTION_MINIMUM.get(where.rsplit(".", 1)[-1], 8)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{where} must be an integer of at least {least}, not {value!r}")
    return value


def _rule(name: str, table: Any) -> RuleConfig:
    where = f"canonical.rules.{name}"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where} must be a table")
    defaults = RULE_OPTIONS[name]
    unknown = set(table) - {"enabled", "dry_run", *defaults}
    if unknown:
        raise ConfigError(f"unknown key(s) in {where}: {', '.join(sorted(unknown))}")
    options = {
        key: _option(f"{where}.{key}", default, table[key]) if key in table else default
        for key, default in defaults.items()
    }
    return RuleConfig(
        enabled=_bool(f"{where}.enabled", table.get("enabled", True)),
        dry_run=_bool(f"{where}.dry_run", table.get("dry_run", False)),
        options=MappingProxyType(options),
    )


def _patterns(items: Any) -> tuple[CustomPattern, ...]:
    if not isinstance(items, list):
        raise ConfigError("canonical.patterns must be an array of {name, regex} tables")
    out: list[CustomPattern] = []
    for item in items:
        if (
            not isinstance(item, Mapping)
            or set(item) != {"name", "regex"}
            or not isinstance(item["name"], str)
            or not isinstance(item["regex"], str)
        ):
            raise ConfigError("each canonical.patterns entry needs exactly a name and a regex")
        out.append(CustomPattern(item["name"], item["regex"]))
    if len({p.name for p in out}) != len(out):
        raise ConfigError("canonical.patterns names must be unique")
    return tuple(out)


def config_from_mapping(table: Mapping[str, Any]) -> CanonicalConfig:
    """The canonicalizer's settings from the ``[canonical]`` table (missing keys: defaults)."""
    known = {
        "enabled",
        "dry_run",
        "note_placement",
        "note_format",
        "note_memory",
        "note_memory_ttl_s",
        "rules",
        "patterns",
    }
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"unknown key(s) in [canonical]: {', '.join(sorted(unknown))}")
    rules_table = table.get("rules", {})
    if not isinstance(rules_table, Mapping):
        raise ConfigError("canonical.rules must be a table of rule tables")
    unknown = set(rules_table) - set(RULE_NAMES)
    if unknown:
        raise ConfigError(f"unknown canonical rule(s): {', '.join(sorted(unknown))}")
    rules = {name: _rule(name, rules_table.get(name, {})) for name in RULE_NAMES}
    placement = table.get("note_placement", "last_suffix")
    ttl = table.get("note_memory_ttl_s", 86_400.0)
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
        raise ConfigError(f"canonical.note_memory_ttl_s must be a positive number, not {ttl!r}")
    note_format = table.get("note_format", DEFAULT_NOTE_FORMAT)
    if not isinstance(note_format, str):
        raise ConfigError("canonical.note_format must be a string")
    return CanonicalConfig(
        enabled=_bool("canonical.enabled", table.get("enabled", True)),
        dry_run=_bool("canonical.dry_run", table.get("dry_run", False)),
        rules=MappingProxyType(rules),
        custom_patterns=_patterns(table.get("patterns", [])),
        note_placement=placement,
        note_format=note_format,
        note_memory=_bool("canonical.note_memory", table.get("note_memory", True)),
        note_memory_ttl_s=float(ttl),
    )
