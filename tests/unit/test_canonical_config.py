"""Canonicalizer settings: the [canonical] TOML table, defaults and fail-fast validation."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from proxy.canonical import RULE_NAMES, CanonicalConfig, RuleConfig, config_from_mapping
from proxy.canonical.config import CustomPattern
from proxy.config import ConfigError

TOML = """
[canonical]
enabled = true
dry_run = false
note_placement = "user_suffix"
note_format = "Values used above:\\n{entries}"

[canonical.rules.stable_json]
sort_tools = false

[canonical.rules.volatile_hex_ids]
enabled = false
min_length = 24

[canonical.rules.volatile_timestamps]
dry_run = true
bare_times = true

[[canonical.patterns]]
name = "request_id"
regex = 'request id: (\\S+)'
"""


def test_rule_names_are_the_contract() -> None:
    """The rule names, in pipeline order, are the ones the analyzer recommends."""
    assert RULE_NAMES == (
        "stable_json",
        "whitespace",
        "volatile_timestamps",
        "volatile_uuids",
        "volatile_hex_ids",
        "custom_patterns",
        "volatile_learned",
    )


def test_defaults_turn_every_rule_on_with_default_options() -> None:
    """An empty table gives every rule on, no dry-run, user_prefix notes."""
    config = config_from_mapping({})
    assert config.enabled and not config.dry_run
    assert config.note_placement == "last_suffix"
    assert all(config.rule(name).enabled for name in RULE_NAMES)
    assert not any(config.rule(name).dry_run for name in RULE_NAMES)
    assert config.rule("volatile_hex_ids").number("min_length") == 16
    assert not config.rule("volatile_timestamps").flag("bare_epochs")
    assert not config.rule("whitespace").flag("raw_prompts")
    assert config == CanonicalConfig()


def test_a_full_toml_table_is_read() -> None:
    """Every key of a TOML [canonical] table lands in the typed config."""
    config = config_from_mapping(tomllib.loads(TOML)["canonical"])
    assert config.note_placement == "user_suffix"
    assert config.note_format == "Values used above:\n{entries}"
    assert not config.rule("stable_json").flag("sort_tools")
    assert config.rule("stable_json").flag("sort_tool_properties")
    assert not config.rule("volatile_hex_ids").enabled
    assert config.rule("volatile_hex_ids").number("min_length") == 24
    assert config.rule("volatile_timestamps").dry_run
    assert config.rule("volatile_timestamps").flag("bare_times")
    (pattern,) = config.custom_patterns
    assert pattern.name == "request_id" and pattern.group == 1


@pytest.mark.parametrize(
    "table",
    [
        {"enable": True},
        {"rules": {"stable_jsn": {}}},
        {"rules": {"whitespace": {"raw_prompt": True}}},
        {"rules": {"whitespace": {"enabled": "yes"}}},
        {"rules": {"volatile_hex_ids": {"min_length": 4}}},
        {"rules": {"volatile_hex_ids": {"min_length": True}}},
        {"rules": []},
        {"note_placement": "before_last_user"},
        {"note_format": "no entries here"},
        {"note_format": 3},
        {"patterns": {"name": "x", "regex": "y"}},
        {"patterns": [{"name": "x"}]},
        {"patterns": [{"name": "Bad Name", "regex": "x"}]},
        {"patterns": [{"name": "x", "regex": "("}]},
        {"patterns": [{"name": "x", "regex": "a*"}]},
        {"patterns": [{"name": "x", "regex": "a"}, {"name": "x", "regex": "b"}]},
    ],
)
def test_bad_tables_fail_fast(table: dict[str, Any]) -> None:
    """Unknown names and keys, wrong types and unusable patterns raise ConfigError."""
    with pytest.raises(ConfigError):
        config_from_mapping(table)


def test_a_config_built_in_code_gets_missing_rules_and_options_filled_in() -> None:
    """Rules and options left out of a hand-built config take their defaults."""
    config = CanonicalConfig(rules={"whitespace": RuleConfig(enabled=False)})
    assert not config.rule("whitespace").enabled
    assert not config.rule("whitespace").flag("raw_prompts")
    assert config.rule("stable_json").flag("sort_tools")


def test_custom_pattern_value_group() -> None:
    """A group named value wins over group 1; no group means the whole match."""
    assert CustomPattern("a", r"(x)(?P<value>y)").group == "value"
    assert CustomPattern("b", r"id=(\w+)").group == 1
    assert CustomPattern("c", r"req-\d+").group == 0
