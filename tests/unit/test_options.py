"""Every option is declared once: flag, variable, TOML key, default and reference come from it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from proxy.config import (
    ENV_PREFIX,
    OPTIONS,
    BackendSpec,
    ConfigError,
    Settings,
    add_serve_arguments,
    options_markdown,
    resolve,
)
from proxy.records import Slo

ROOT = Path(__file__).resolve().parents[2]
BACKEND = {"backend": ["http://b:1"]}


def _at(settings: Settings, path: tuple[str, ...]) -> Any:
    value: Any = settings
    for name in path:
        value = getattr(value, name)
    return value


def test_names_are_derived_from_one_declaration() -> None:
    """Each option's flag and environment variable are made from its TOML key, all unique."""
    assert len({o.name for o in OPTIONS}) == len(OPTIONS)
    for opt in OPTIONS:
        assert opt.env == ENV_PREFIX + opt.name.upper()
        assert opt.cli == "--" + opt.name.replace("_", "-")
        assert opt.path, opt.name


def test_dataclass_defaults_are_the_option_defaults() -> None:
    """Settings built in code hold the same defaults as the resolved configuration."""
    built = Settings(backends=(BackendSpec(url="http://b:1"),))
    for opt in OPTIONS[1:]:  # the backends are given
        assert _at(built, opt.path) == opt.default, opt.name
    assert resolve(BACKEND, environ={}) == built


def test_every_option_is_read_from_flag_env_and_toml(tmp_path: Path) -> None:
    """A value given by flag, by environment or in the TOML file lands at the option's field."""
    samples: dict[str, tuple[str, Any]] = {
        "port": ("7001", 7001),
        "log_level": ("DEBUG", "debug"),
        "slo_ttft_ms": ("off", None),
        "health_failures": ("5", 5),
        "policy": ("least-loaded", "least-loaded"),
        "fanout": ("on", True),
        "session_header": ("X-Thread", ("x-thread",)),
    }
    by_name = {o.name: o for o in OPTIONS}
    for name, (text, want) in samples.items():
        opt = by_name[name]
        from_flag = resolve({**BACKEND, name: [text] if opt.repeat else text}, environ={})
        from_env = resolve(BACKEND, environ={opt.env: text})
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(
            f"[proxy]\n{name} = {[text] if opt.repeat else repr(text)}\n".replace("'", '"')
        )
        from_toml = resolve({**BACKEND, "config": str(cfg)}, environ={})
        for settings in (from_flag, from_env, from_toml):
            assert _at(settings, opt.path) == want, name


@pytest.mark.parametrize(
    "args,match",
    [
        ({"log_level": "loud"}, "--log-level must be one of debug, info, warning, error"),
        ({"passthrough": "some"}, "--passthrough must be one of"),
        ({"server_kv_unified": "maybe"}, "--server-kv-unified must be one of"),
        ({"policy": "random"}, "--policy must be one of"),
    ],
)
def test_choices_are_validated(args: dict[str, str], match: str) -> None:
    """An option with a fixed set of values refuses any other, naming the flag and the set."""
    with pytest.raises(ConfigError, match=match):
        resolve({**BACKEND, **args}, environ={})


def test_start_up_resources_fail_in_resolve(tmp_path: Path) -> None:
    """The keys file, the redaction patterns and the canonical table are checked by resolve."""
    with pytest.raises(ConfigError, match="cannot read"):
        resolve({**BACKEND, "api_keys_file": str(tmp_path / "none")}, environ={})
    bad_keys = tmp_path / "keys"
    bad_keys.write_text("a b c\n")
    with pytest.raises(ConfigError):
        resolve({**BACKEND, "api_keys_file": str(bad_keys)}, environ={})
    with pytest.raises(ConfigError, match="redact"):
        resolve({**BACKEND, "redact_pattern": ["("]}, environ={})
    cfg = tmp_path / "p.toml"
    cfg.write_text("[canonical]\nrelocate = false\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) in \[canonical\]"):
        resolve({**BACKEND, "config": str(cfg)}, environ={})
    # A configuration checked for another machine leaves its files unread.
    other = resolve(
        {**BACKEND, "api_keys_file": str(tmp_path / "none")}, environ={}, read_files=False
    )
    assert other.api_keys_file == str(tmp_path / "none")


def test_help_names_every_option_with_its_variable() -> None:
    """--help lists each option with its environment variable."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    text = " ".join(parser.format_help().split())
    for opt in OPTIONS:
        assert opt.cli in text and opt.env in text, opt.name


def test_reference_has_a_row_per_option() -> None:
    """The Markdown reference carries one row per option: flag, variable, key and default."""
    text = options_markdown()
    rows = [line for line in text.splitlines() if line.startswith("| `--")][1:]  # --config
    assert len(rows) == len(OPTIONS)
    for opt, row in zip(OPTIONS, rows, strict=True):
        assert f"`{opt.env}`" in row and f"`{opt.name}`" in row
    slo = next(r for r in rows if "`slo_ttft_ms`" in r)
    assert "`2000.0`" in slo


def test_docs_options_is_up_to_date() -> None:
    """docs/options.md is the generated reference; run `make docs` after changing an option."""
    path = ROOT / "docs" / "options.md"
    assert path.read_text() == options_markdown(), "docs/options.md is stale: make docs"


def test_value_objects_keep_their_neutral_defaults() -> None:
    """Slo() alone has no objective: the proxy's default SLO lives on the option, not on Slo."""
    assert Settings(backends=()).slo == Slo(ttft_ms=2000.0, tpot_ms=100.0)
    assert Slo().ttft_ms is None and Slo().tpot_ms is None
