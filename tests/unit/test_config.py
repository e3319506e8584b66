"""Settings resolution: precedence, parsing, validation."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from proxy.config import ConfigError, Timeouts, add_serve_arguments, resolve


def test_defaults() -> None:
    """With only a backend, every other setting takes its documented default."""
    s = resolve({"backend": ["http://b:8080/"]}, environ={})
    assert [b.url for b in s.backends] == ["http://b:8080"]
    assert s.timeouts == Timeouts(connect=10.0, idle=600.0, store=0.005)
    assert (s.dialect, s.port, s.max_body_bytes) == ("auto", 8000, 32 * 1024 * 1024)
    assert (s.slo.ttft_ms, s.slo.tpot_ms) == (2000.0, 100.0)
    assert s.redis_url is None and s.canonicalize is True


def test_no_backend_is_an_error() -> None:
    """A proxy without a backend refuses to start."""
    with pytest.raises(ConfigError, match="no backend"):
        resolve({}, environ={})


def test_precedence_flags_env_toml(tmp_path: Path) -> None:
    """Flags beat environment, environment beats the TOML file, the file beats defaults."""
    cfg = tmp_path / "p.toml"
    cfg.write_text(
        '[proxy]\nport = 7000\nidle_timeout = 5\nlog_level = "debug"\n'
        'backends = ["http://toml:1"]\n[canonical]\ndry_run = false\n'
    )
    env = {"PREFIXGATE_CONFIG": str(cfg), "PREFIXGATE_PORT": "7100", "PREFIXGATE_IDLE_TIMEOUT": "6"}
    s = resolve({"idle_timeout": 7.0}, environ=env)
    assert s.timeouts.idle == 7.0
    assert s.port == 7100
    assert s.log_level == "debug"
    assert [b.url for b in s.backends] == ["http://toml:1"]
    assert s.canonical == {"dry_run": False}
    assert s.config_file == str(cfg)


def test_backends_weights_and_commas() -> None:
    """Backends may be comma-separated and carry URL=WEIGHT."""
    s = resolve({}, environ={"PREFIXGATE_BACKEND": "http://a:1=2, http://b:2"})
    assert [(b.url, b.weight) for b in s.backends] == [("http://a:1", 2.0), ("http://b:2", 1.0)]


@pytest.mark.parametrize(
    "text,size",
    [("1024", 1024), ("4k", 4096), ("2MiB", 2 * 1024**2), ("1g", 1024**3), ("1.5k", 1536)],
)
def test_body_size_suffixes(text: str, size: int) -> None:
    """max_body_bytes accepts k/m/g suffixes (binary)."""
    s = resolve({"backend": ["http://b"]}, environ={"PREFIXGATE_MAX_BODY_BYTES": text})
    assert s.max_body_bytes == size


def test_slo_off_and_booleans() -> None:
    """'off' disables an SLO bound; boolean environment values parse."""
    env = {
        "PREFIXGATE_SLO_TPOT_MS": "off",
        "PREFIXGATE_LOG_PROMPTS": "yes",
        "PREFIXGATE_CANONICALIZE": "0",
    }
    s = resolve({"backend": ["http://b"]}, environ=env)
    assert s.slo.tpot_ms is None and s.slo.ttft_ms == 2000.0
    assert s.log_prompts is True and s.canonicalize is False


@pytest.mark.parametrize(
    "args,match",
    [
        ({"backend": ["ftp://b"]}, "http"),
        ({"backend": ["http://b"], "dialect": "tgi"}, "dialect"),
        ({"backend": ["http://b"], "block_bytes": 8}, "block-bytes"),
        ({"backend": ["http://b"], "port": "eighty"}, "--port"),
        ({"backend": ["http://b"], "store_write_delay_ms": "-1"}, "store-write-delay-ms"),
        ({"backend": ["http://b"], "store_write_delay_ms": "nan"}, "store-write-delay-ms"),
        ({"backend": ["http://b"], "store_write_delay_ms": "5000"}, "at most 1000"),
    ],
)
def test_bad_values(args: dict[str, object], match: str) -> None:
    """Unusable values fail with a ConfigError naming the setting."""
    with pytest.raises(ConfigError, match=match):
        resolve(args, environ={})


def test_unreadable_config_file(tmp_path: Path) -> None:
    """A missing or broken TOML file is a ConfigError."""
    with pytest.raises(ConfigError, match="cannot read"):
        resolve({"backend": ["http://b"]}, environ={"PREFIXGATE_CONFIG": str(tmp_path / "no")})


def test_cli_arguments() -> None:
    """The CLI declares every option; repeated --backend and --no-canonicalize work."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    ns = parser.parse_args(
        [
            "--backend",
            "http://a",
            "--backend",
            "http://b",
            "--no-canonicalize",
            "--idle-timeout",
            "3",
        ]
    )
    s = resolve(ns, environ={})
    assert [b.url for b in s.backends] == ["http://a", "http://b"]
    assert s.canonicalize is False and s.timeouts.idle == 3.0
