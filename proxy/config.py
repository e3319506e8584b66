"""Settings: one frozen object, resolved once at start-up.

Sources, highest precedence first: command-line flags, ``PREFIXGATE_*`` environment variables,
the optional TOML file (``--config`` / ``PREFIXGATE_CONFIG``), then defaults. Nothing else in the
proxy reads ``os.environ``. Every option is declared once, on the dataclass field that holds it
(``proxy.options.option``: here, and on the value objects ``Settings`` groups); ``OPTIONS`` is
collected from those declarations, and the CLI's ``--help``, the environment names, the TOML keys,
the defaults and the option reference (``options_markdown``, ``docs/options.md``) all come from
it. ``resolve`` validates everything at start-up, the keys file, the redaction patterns and the
``[canonical]`` table included, so a bad setting stops the proxy before it listens.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.backends import DIALECT_NAMES
from proxy.control import ControlGroup
from proxy.fingerprint import DEFAULT_BLOCK_BYTES
from proxy.hosted import HostedFields
from proxy.log import LOG_LEVELS
from proxy.options import (
    ENV_PREFIX,
    ConfigError,
    Option,
    collect,
    group,
    groups,
    option,
    split_items,
    to_bool,
    to_lower,
    to_opt_float,
    to_size,
)
from proxy.options import options_markdown as _render
from proxy.records import Pricing, Slo
from proxy.redact import Redactor
from proxy.routing import RoutingConfig
from proxy.scheduling.config import SchedulingConfig
from proxy.store import StoreOptions

_STORE = StoreOptions()  # the store's own defaults are the options' (declared there once)

PASSTHROUGH_MODES = ("all", "read-only", "off")
DIALECTS = ("auto", *DIALECT_NAMES)
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def _redis_url(value: Any) -> str | None:
    """A Redis URL of a scheme the store opens (``redis+cluster://`` for a Redis Cluster)."""
    text = str(value).strip()
    if not text:
        return None
    scheme, sep, _ = text.partition("://")
    if not sep or scheme.lower() not in REDIS_SCHEMES:
        raise ValueError(f"the scheme must be one of {', '.join(s + '://' for s in REDIS_SCHEMES)}")
    return text


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One backend replica."""

    url: str
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Timeouts in seconds. A stream never has a total timeout."""

    connect: float = option(
        10.0, "seconds to connect to a backend (504 after)", cast=float, metavar="S"
    )
    idle: float = option(
        600.0,
        "seconds without a byte from the backend before giving up "
        "(504, or an error event mid-stream); never a total timeout",
        cast=float,
        metavar="S",
    )
    store: float = option(
        _STORE.timeouts.lookup_s,
        "seconds the request path waits for the shared store before serving without it "
        "(its background writes get ten times as long)",
        cast=float,
        metavar="S",
    )
    client: float = option(
        60.0,
        "seconds a client may stall: sending its request body (408 after) or accepting the "
        "response (its connection is closed after, and the backend request with it)",
        cast=float,
        metavar="S",
    )
    """Longest silence from a client while it sends its request body (408 after)."""


@dataclass(frozen=True, slots=True)
class HealthChecks:
    """Active health checks and backend load polling, run per replica in the background."""

    interval_s: float = option(
        2.0,
        "seconds between health checks of each backend (and reads of its own load)",
        cast=float,
        metavar="S",
    )
    """Seconds between two checks of a replica (and between two reads of its own load)."""
    failures: int = option(
        3,
        "consecutive failed health checks that eject a backend until it passes again",
        cast=int,
        metavar="N",
    )
    """Consecutive failed checks that eject a replica; one passing check brings it back."""
    timeout_s: float = option(2.0, "seconds a health check may take", cast=float, metavar="S")
    """Longest a check may take before it counts as failed."""
    backend_load: bool = option(
        True,
        "route with each backend's own load too, where the server reports it (running and "
        "queued requests), read on the health-check interval",
        cast=to_bool,
        is_flag=True,
        name="backend_load",
    )
    """Read each backend's own load (its dialect's ``Capabilities.load_sources``)."""


def _backends(value: Any) -> tuple[BackendSpec, ...]:
    items: list[Any] = []
    for v in value if isinstance(value, list | tuple) else [value]:
        if isinstance(v, Mapping):
            items.append(
                BackendSpec(url=str(v["url"]).rstrip("/"), weight=float(v.get("weight", 1.0)))
            )
        else:
            items.extend(_parse_backend(p) for p in str(v).split(",") if p.strip())
    return tuple(items)


def _parse_backend(text: str) -> BackendSpec:
    url, _, weight = text.strip().partition("=")
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"backend URL must start with http:// or https://: {text!r}")
    return BackendSpec(url=url, weight=float(weight) if weight else 1.0)


def _listen_hosts(values: Any) -> tuple[str, ...]:
    """Listen addresses, each once, in the order given (a ``[::1]`` bracket form is unwrapped)."""
    out: list[str] = []
    for value in split_items(values, ","):
        for part in str(value).split(","):
            host = part.strip()
            if host.startswith("[") and host.endswith("]"):
                host = host[1:-1]
            if host and host not in out:
                out.append(host)
    if not out:
        raise ConfigError("--host needs at least one address")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the proxy is configured with.

    Each field that is a setting declares its option (``proxy.options.option``); the groups
    (``timeouts``, ``slo``, ``routing``...) are value objects whose fields declare theirs.
    """

    backends: tuple[BackendSpec, ...] = option(
        (),
        "backend base URL (repeat for replicas; URL=WEIGHT sets a weight)",
        name="backend",
        repeat=True,
        metavar="URL",
        parse=_backends,
    )
    hosts: tuple[str, ...] = option(
        ("127.0.0.1",),
        "address to listen on (repeat, or comma-separate, for several: 127.0.0.1,::1)",
        name="host",
        repeat=True,
        metavar="ADDR",
        parse=_listen_hosts,
    )
    """Addresses the traffic listener binds (``--host``, several allowed)."""
    port: int = option(8000, "port to listen on", cast=int)
    admin_hosts: tuple[str, ...] | None = option(
        None,
        "address of the admin listener (/stats, /dashboard, /metrics, /healthz, /readyz); "
        "repeat for several (default: the --host addresses)",
        name="admin_host",
        repeat=True,
        metavar="ADDR",
        parse=lambda raw: _listen_hosts(raw) if split_items(raw, ",") else None,
    )
    """Addresses of the admin listener; None: the traffic listener's."""
    admin_port: int = option(
        8001,
        "port of the admin listener, apart from the backend's paths (0: any free port)",
        cast=int,
    )
    dialect: str = option(
        "auto",
        "backend dialect: auto (ask the server who it is) or the one to assume",
        choices=DIALECTS,
    )
    backend_api_key: str | None = option(
        None, "API key the proxy sends to the backend (kept server-side)"
    )
    redis_url: str | None = option(
        None,
        "Redis URL for shared prefix index and statistics (default: embedded in-process store); "
        "redis+cluster://HOST:PORT[,HOST:PORT...] for a Redis or Valkey Cluster",
        cast=_redis_url,
        metavar="URL",
    )
    log_file: str | None = option(
        None, "write request records (JSON lines) here instead of stdout", metavar="PATH"
    )
    log_level: str = option("info", "log level", cast=to_lower, choices=LOG_LEVELS)
    log_prompts: bool = option(
        False,
        "opt in to logging request bodies in records (off: only hashes and sizes are logged)",
        cast=to_bool,
        is_flag=True,
    )
    max_body_bytes: int = option(
        32 * 1024 * 1024,
        "largest request body accepted (413 above); k/m/g suffixes",
        cast=to_size,
        metavar="BYTES",
    )
    timeouts: Timeouts = group(Timeouts, suffix="_timeout")
    slo: Slo = group(
        Slo,
        prefix="slo_",
        options={
            "ttft_ms": option(
                2000.0,
                "SLO on time to first token, ms ('off' to disable)",
                cast=to_opt_float,
                metavar="MS",
            ),
            "tpot_ms": option(
                100.0,
                "SLO on time per output token, ms ('off' to disable)",
                cast=to_opt_float,
                metavar="MS",
            ),
        },
    )
    pricing: Pricing = group(
        Pricing,
        prefix="price_",
        options={
            "input_per_mtok": option(
                None,
                "USD per million uncached input tokens (enables saved_usd)",
                cast=to_opt_float,
                metavar="USD",
            ),
            "cached_input_per_mtok": option(
                None, "USD per million cached input tokens", cast=to_opt_float, metavar="USD"
            ),
        },
    )
    block_bytes: int = option(
        DEFAULT_BLOCK_BYTES, "prefix block size in bytes for fingerprints", cast=int, metavar="N"
    )
    capacity_tokens: int | None = option(
        None,
        "prefix-index capacity per replica in tokens "
        "(default: what the backend says about itself, else 131072)",
        cast=int,
        metavar="N",
    )
    stats_retention_s: int = option(
        int(_STORE.stats_retention_s),
        "how long statistics are kept, seconds",
        cast=int,
        metavar="S",
    )
    routing: RoutingConfig = group(RoutingConfig, label="routing")
    traffic_window_s: float = option(
        _STORE.traffic_window_s,
        "prefix-affinity: bucket length of the recent-traffic counts, seconds (a read covers "
        "one to two buckets)",
        cast=float,
        metavar="S",
    )
    """Bucket length of the recent-traffic counts behind the traffic-shared depth."""
    traffic_max_hashes: int = option(
        _STORE.traffic_max_hashes,
        "prefix-affinity: most distinct block hashes one recent-traffic bucket counts per "
        "tenant; a full bucket still counts the ones it holds (bounds the counts' memory)",
        cast=int,
        metavar="N",
    )
    """Distinct block hashes one traffic bucket counts per tenant (``TRAFFIC_MAX_HASHES``)."""
    store_write_delay_ms: float = option(
        5.0,
        "how long the store's writes (claims, in-flight counts, learned prefixes, statistics) "
        "are held to be sent together, milliseconds; 0 sends each at once",
        cast=float,
        metavar="MS",
    )
    """Write behind (``proxy.store.write_behind``): other proxies see a write this much later."""
    health: HealthChecks = group(HealthChecks, prefix="health_")
    scheduling: SchedulingConfig = group(SchedulingConfig, label="scheduling")
    canonicalize: bool = option(
        True,
        "rewrite prompts so stable segments come first (--no-canonicalize turns it off)",
        cast=to_bool,
        is_flag=True,
    )
    canonical_dry_run: bool = option(
        False,
        "compute and record canonicalization, forward the original",
        cast=to_bool,
        is_flag=True,
    )
    canonical: Mapping[str, Any] = field(default_factory=dict)
    """The ``[canonical]`` table of the TOML file (``proxy.canonical.config_from_mapping``)."""
    control: ControlGroup = group(ControlGroup, prefix="control_", label="control group")
    """The share of conversations left alone to measure the gain (``proxy.control``)."""
    admin_token: str | None = option(
        None, "bearer token required on the admin listener's /stats, /dashboard and /metrics"
    )
    api_keys: tuple[str, ...] = option(
        (),
        "client API key the proxy requires as 'Authorization: Bearer KEY' (repeat for several)",
        name="api_key",
        repeat=True,
        metavar="KEY",
    )
    api_keys_file: str | None = option(
        None, "file of client API keys, one 'KEY [TENANT]' per line", metavar="PATH"
    )
    passthrough: str = option(
        "all",
        "what the proxy forwards besides chat, completions and /completion: all (every other "
        "path and method), read-only (GET, HEAD and OPTIONS only) or off (nothing: 404)",
        metavar="MODE",
        choices=PASSTHROUGH_MODES,
    )
    """What is forwarded besides the inference routes: one of ``PASSTHROUGH_MODES``."""
    tenant_header: str | None = option(
        None,
        "request header naming the tenant (refines the key's tenant when keys are set)",
        metavar="NAME",
    )
    hosted: HostedFields = group(HostedFields)
    """Conversation keys (``prompt_cache_key``, session headers) and hosted-only fields."""
    redact_patterns: tuple[str, ...] = option(
        (),
        "extra regular expression redacted from logged prompt text (repeat; env: one per line)",
        name="redact_pattern",
        repeat=True,
        metavar="REGEX",
        sep="\n",
    )
    redact_defaults: bool = option(
        True,
        "redact API keys, tokens and emails from logged prompt text (--log-prompts)",
        cast=to_bool,
        is_flag=True,
    )
    config_file: str | None = None

    @property
    def primary_backend(self) -> BackendSpec:
        return self.backends[0]

    @property
    def host(self) -> str:
        """The first address the traffic listener binds."""
        return self.hosts[0]

    @property
    def admin_listen(self) -> tuple[str, ...]:
        """Addresses the admin listener binds."""
        return self.admin_hosts or self.hosts


OPTIONS: tuple[Option, ...] = collect(Settings)
"""Every option, in declaration order (collected from ``Settings`` and its groups)."""
_BY_NAME = {o.name: o for o in OPTIONS}
_GROUPS = groups(Settings)


REFERENCE_HEADER = f"""\
# Option reference

<!-- Generated by docs/gen_options.py from the option declarations (proxy.config.OPTIONS);
     do not edit by hand: run `make docs`. -->

Every option of `prefixgate serve`, generated from the declarations the proxy parses. Each is
a flag, an environment variable (`{ENV_PREFIX}<NAME>`) and a key of the TOML file's `[proxy]`
table; precedence is flags, then environment, then the TOML file (`--config FILE` or
`{ENV_PREFIX}CONFIG`), then the default. A repeatable option takes a list in TOML and, in its
environment variable, comma-separated values (one per line where noted). An on/off switch
takes `--name` / `--no-name` as a flag and `true`/`false`, `on`/`off`, `1`/`0` elsewhere.
The TOML file may also call `backend` `backends`. `prefixgate serve --help` prints the same
list. [Configuration](configuration.md) explains the common settings, and the canonicalizer's
own `[canonical]` TOML table is described in [the canonicalizer](canonicalizer.md). Every value
is checked at start-up, the keys file, the redaction patterns and the `[canonical]` table
included: a bad one stops `prefixgate serve` with one line naming it (exit status 2).

| flag | environment | TOML key | default | meaning |
|---|---|---|---|---|
| `--config FILE` | `{ENV_PREFIX}CONFIG` | — | — | TOML settings file |
"""


def options_markdown() -> str:
    """The option reference (``docs/options.md``), generated from the declarations."""
    return _render(OPTIONS, header=REFERENCE_HEADER)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every option on ``parser``; defaults are left to ``resolve``."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"TOML settings file (env {ENV_PREFIX}CONFIG)",
    )
    for opt in OPTIONS:
        env = f"env {opt.env}"
        shown = f"; default {opt.default}" if opt.default not in (None, False, ()) else ""
        if opt.choices:
            shown = f"; one of {', '.join(opt.choices)}{shown}"
        kwargs: dict[str, Any] = {"dest": opt.name, "default": argparse.SUPPRESS}
        if opt.is_flag:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = opt.metavar
        if opt.repeat:
            kwargs["action"] = "append"
            shown = ", comma-separated" if opt.sep == "," else ", one per line"
            if opt.default:
                shown += f"; default {', '.join(map(str, opt.default))}"
        parser.add_argument(opt.cli, help=f"{opt.help} ({env}{shown})", **kwargs)


def _value(opt: Option, raw: Any) -> Any:
    """One option's value from a flag, an environment variable or a TOML value."""
    if opt.parse is not None:
        value = opt.parse(raw)
    elif opt.repeat:
        value = tuple(opt.cast(v) for v in split_items(raw, opt.sep))
    else:
        value = opt.cast(raw)
    if opt.choices:
        given = value if opt.repeat else (value,)
        unknown = [str(v) for v in given or () if v not in opt.choices]
        if unknown:
            more = " (repeat it, or 'none' for no value)" if opt.repeat else ""
            raise ConfigError(
                f"{opt.cli} must be one of {', '.join(opt.choices)}{more}, not {', '.join(unknown)}"
            )
    return value


def _build(values: Mapping[str, Any], **extra: Any) -> Settings:
    """``Settings`` from each option's value (by name), its groups built and validated."""
    top: dict[str, Any] = dict(extra)
    nested: dict[str, dict[str, Any]] = {name: {} for name in _GROUPS}
    for opt in OPTIONS:
        if len(opt.path) == 1:
            top[opt.path[0]] = values[opt.name]
        else:
            nested[opt.path[0]][opt.path[1]] = values[opt.name]
    for name, kwargs in nested.items():
        cls, label = _GROUPS[name]
        try:
            top[name] = cls(**kwargs)
        except ValueError as exc:
            raise ConfigError(f"bad {label or name} setting: {exc}") from exc
    return Settings(**top)


def _check(settings: Settings, *, read_files: bool) -> None:
    """What no single option can say alone; and what ``build_app`` would otherwise find late."""
    backends = settings.backends
    if not backends:
        raise ConfigError(f"no backend configured: pass --backend URL or set {ENV_PREFIX}BACKEND")
    if any(not b.weight > 0 for b in backends):
        raise ConfigError("a backend weight must be a positive number (URL=WEIGHT)")
    if len({b.url for b in backends}) != len(backends):
        raise ConfigError("the same backend URL is configured twice")
    if settings.block_bytes < 16:
        raise ConfigError("--block-bytes must be at least 16")
    health = settings.health
    if not health.interval_s > 0 or not health.timeout_s > 0:
        raise ConfigError("--health-interval-s and --health-timeout-s must be positive")
    if health.failures < 1:
        raise ConfigError("--health-failures must be at least 1")
    if not (math.isfinite(settings.traffic_window_s) and settings.traffic_window_s > 0):
        raise ConfigError("--traffic-window-s must be a positive number")
    if settings.traffic_max_hashes < 1:
        raise ConfigError("--traffic-max-hashes must be at least 1")
    if not (math.isfinite(settings.store_write_delay_ms) and settings.store_write_delay_ms >= 0):
        raise ConfigError("--store-write-delay-ms must be a number of milliseconds, 0 or more")
    if settings.store_write_delay_ms > 1000:
        raise ConfigError("--store-write-delay-ms is at most 1000 (other proxies wait that long)")
    if not 0 <= settings.port <= 65535 or not 0 <= settings.admin_port <= 65535:
        raise ConfigError("--port and --admin-port must be between 0 and 65535")
    if settings.port and settings.port == settings.admin_port:
        raise ConfigError(
            "--admin-port must differ from --port: the admin routes live apart from the "
            "backend's paths"
        )
    check_resources(settings, read_files=read_files)


def check_resources(settings: Settings, *, read_files: bool = True) -> None:
    """The settings that name files or patterns: the keys file is read (unless ``read_files``
    is False), the redaction patterns and the ``[canonical]`` table compiled (``ConfigError``
    on any failure)."""
    # Imported here: the key store and the canonicalizer sit above the settings in the house
    # (proxy.state, which proxy.auth uses, holds a Settings; proxy.canonical raises ConfigError).
    from proxy.auth import KeysFileError, load_keys
    from proxy.canonical import config_from_mapping

    try:
        load_keys(settings.api_keys, settings.api_keys_file if read_files else None)
    except KeysFileError as exc:
        raise ConfigError(str(exc)) from exc
    try:
        Redactor.build(settings.redact_patterns, defaults=settings.redact_defaults)
    except re.error as exc:
        raise ConfigError(f"bad --redact-pattern: {exc}") from exc
    config_from_mapping(settings.canonical)


def resolve(
    args: Mapping[str, Any] | argparse.Namespace,
    *,
    environ: Mapping[str, str] | None = None,
    read_files: bool = True,
) -> Settings:
    """Build the one ``Settings`` object from flags, environment and TOML file, and validate it.

    ``read_files=False`` leaves the files the settings name unread (the keys file): for
    checking a configuration meant for another machine.
    """
    flags = dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args)
    env = dict(os.environ if environ is None else environ)
    config_path = flags.pop("config", None) or env.get(ENV_PREFIX + "CONFIG")
    toml: dict[str, Any] = {}
    if config_path:
        try:
            toml = tomllib.loads(Path(config_path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {config_path}: {exc}") from exc
    proxy_table = dict(toml.get("proxy", {}))
    proxy_table.update({k: v for k, v in toml.items() if k in _BY_NAME or k == "backends"})
    if "backends" in proxy_table:
        proxy_table.setdefault("backend", proxy_table.pop("backends"))

    values: dict[str, Any] = {}
    for opt in OPTIONS:
        raw: Any
        if opt.name in flags:
            raw = flags[opt.name]
        elif opt.env in env:
            raw = env[opt.env]
        elif opt.name in proxy_table:
            raw = proxy_table[opt.name]
        else:
            values[opt.name] = opt.default
            continue
        try:
            values[opt.name] = _value(opt, raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad value for {opt.cli}: {raw!r} ({exc})") from exc

    settings = _build(
        values,
        canonical=dict(toml.get("canonical", {})),
        config_file=str(config_path) if config_path else None,
    )
    _check(settings, read_files=read_files)
    return settings


__all__ = [
    "DIALECTS",
    "ENV_PREFIX",
    "OPTIONS",
    "PASSTHROUGH_MODES",
    "BackendSpec",
    "ConfigError",
    "HealthChecks",
    "Option",
    "Settings",
    "Timeouts",
    "add_serve_arguments",
    "check_resources",
    "options_markdown",
    "resolve",
]
