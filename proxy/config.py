"""Settings: one frozen object, resolved once at start-up.

Sources, highest precedence first: command-line flags, ``PREFIXGATE_*`` environment variables,
the optional TOML file (``--config`` / ``PREFIXGATE_CONFIG``), then defaults. Nothing else in the
proxy reads ``os.environ``. Every option is declared once in ``OPTIONS``; the CLI's ``--help``,
the environment names and the TOML keys all come from that table.
"""

from __future__ import annotations

import argparse
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.backends import DIALECT_NAMES
from proxy.hosted import DEFAULT_SESSION_HEADERS, DEFAULT_STRIP_DIALECTS, HostedFields
from proxy.records import Pricing, Slo
from proxy.routing import POLICIES, RoutingConfig
from proxy.scheduling.config import SLOT_MODES, SchedulingConfig

ENV_PREFIX = "PREFIXGATE_"
PASSTHROUGH_MODES = ("all", "read-only", "off")
DIALECTS = ("auto", *DIALECT_NAMES)


class ConfigError(Exception):
    """A setting is missing or has a value that cannot be used."""


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One backend replica."""

    url: str
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Timeouts in seconds. A stream never has a total timeout."""

    connect: float = 10.0
    idle: float = 600.0
    store: float = 0.005
    client: float = 60.0
    """Longest silence from a client while it sends its request body (408 after)."""


@dataclass(frozen=True, slots=True)
class HealthChecks:
    """Active health checks and backend load polling, run per replica in the background."""

    interval_s: float = 2.0
    """Seconds between two checks of a replica (and between two reads of its own load)."""
    failures: int = 3
    """Consecutive failed checks that eject a replica; one passing check brings it back."""
    timeout_s: float = 2.0
    """Longest a check may take before it counts as failed."""
    backend_load: bool = True
    """Read each backend's own load (llama.cpp ``/slots`` or ``/metrics``, vLLM ``/metrics``)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the proxy is configured with."""

    backends: tuple[BackendSpec, ...]
    hosts: tuple[str, ...] = ("127.0.0.1",)
    """Addresses the traffic listener binds (``--host``, several allowed)."""
    port: int = 8000
    admin_hosts: tuple[str, ...] | None = None
    """Addresses of the admin listener; None: the traffic listener's."""
    admin_port: int = 8001
    dialect: str = "auto"
    backend_api_key: str | None = None
    redis_url: str | None = None
    log_file: str | None = None
    log_level: str = "info"
    log_prompts: bool = False
    max_body_bytes: int = 32 * 1024 * 1024
    timeouts: Timeouts = field(default_factory=Timeouts)
    slo: Slo = field(default_factory=Slo)
    pricing: Pricing = field(default_factory=Pricing)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    health: HealthChecks = field(default_factory=HealthChecks)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    block_bytes: int = 256
    capacity_tokens: int | None = None
    stats_retention_s: int = 7 * 24 * 3600
    traffic_window_s: float = 120.0
    """Bucket length of the recent-traffic counts behind the traffic-shared depth."""
    canonicalize: bool = True
    canonical_dry_run: bool = False
    canonical: Mapping[str, Any] = field(default_factory=dict)
    admin_token: str | None = None
    passthrough: str = "all"
    """What is forwarded besides the inference routes: one of ``PASSTHROUGH_MODES``."""
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    tenant_header: str | None = None
    hosted: HostedFields = field(default_factory=HostedFields)
    """Conversation keys (``prompt_cache_key``, session headers) and hosted-only fields."""
    redact_patterns: tuple[str, ...] = ()
    redact_defaults: bool = True
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


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {value!r}")


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


def _opt_float(value: Any) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in {"", "none", "off"}):
        return None
    return float(value)


def _size(value: Any) -> int:
    """Bytes, accepting suffixes k/m/g (binary)."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": 1024, "m": 1024**2, "g": 1024**3}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its flag, environment variable, TOML key, type and help."""

    name: str
    cast: Callable[[Any], Any]
    help: str
    default: Any = None
    flag: str | None = None
    metavar: str | None = None
    is_flag: bool = False
    repeat: bool = False
    sep: str = ","
    """How a repeated option's environment variable separates its values."""

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def cli(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option(
        "backend",
        str,
        "backend base URL (repeat for replicas; URL=WEIGHT sets a weight)",
        repeat=True,
        metavar="URL",
    ),
    Option(
        "host",
        str,
        "address to listen on (repeat, or comma-separate, for several: 127.0.0.1,::1)",
        repeat=True,
        metavar="ADDR",
    ),
    Option("port", int, "port to listen on", 8000),
    Option(
        "admin_host",
        str,
        "address of the admin listener (/stats, /dashboard, /metrics, /healthz, /readyz); "
        "repeat for several (default: the --host addresses)",
        repeat=True,
        metavar="ADDR",
    ),
    Option(
        "admin_port",
        int,
        "port of the admin listener, apart from the backend's paths (0: any free port)",
        8001,
    ),
    Option(
        "dialect",
        str,
        "backend dialect: auto (ask the server who it is), " + ", ".join(DIALECT_NAMES),
        "auto",
    ),
    Option("backend_api_key", str, "API key the proxy sends to the backend (kept server-side)"),
    Option(
        "redis_url",
        _redis_url,
        "Redis URL for shared prefix index and statistics (default: embedded in-process store); "
        "redis+cluster://HOST:PORT[,HOST:PORT...] for a Redis or Valkey Cluster",
        metavar="URL",
    ),
    Option(
        "log_file", str, "write request records (JSON lines) here instead of stdout", metavar="PATH"
    ),
    Option("log_level", str, "log level: debug, info, warning, error", "info"),
    Option(
        "log_prompts",
        _bool,
        "opt in to logging request bodies in records (off: only hashes and sizes are logged)",
        False,
        is_flag=True,
    ),
    Option(
        "max_body_bytes",
        _size,
        "largest request body accepted (413 above); k/m/g suffixes",
        32 * 1024 * 1024,
        metavar="BYTES",
    ),
    Option(
        "connect_timeout", float, "seconds to connect to a backend (504 after)", 10.0, metavar="S"
    ),
    Option(
        "idle_timeout",
        float,
        "seconds without a byte from the backend before giving up "
        "(504, or an error event mid-stream); never a total timeout",
        600.0,
        metavar="S",
    ),
    Option(
        "client_timeout",
        float,
        "seconds a client may stall: sending its request body (408 after) or accepting the "
        "response (its connection is closed after, and the backend request with it)",
        60.0,
        metavar="S",
    ),
    Option(
        "store_timeout",
        float,
        "seconds the request path waits for the shared store before serving without it",
        0.005,
        metavar="S",
    ),
    Option(
        "slo_ttft_ms",
        _opt_float,
        "SLO on time to first token, ms ('off' to disable)",
        2000.0,
        metavar="MS",
    ),
    Option(
        "slo_tpot_ms",
        _opt_float,
        "SLO on time per output token, ms ('off' to disable)",
        100.0,
        metavar="MS",
    ),
    Option(
        "price_input_per_mtok",
        _opt_float,
        "USD per million uncached input tokens (enables saved_usd)",
        None,
        metavar="USD",
    ),
    Option(
        "price_cached_input_per_mtok",
        _opt_float,
        "USD per million cached input tokens",
        None,
        metavar="USD",
    ),
    Option("block_bytes", int, "prefix block size in bytes for fingerprints", 256, metavar="N"),
    Option(
        "capacity_tokens",
        int,
        "prefix-index capacity per replica in tokens "
        "(default: from the backend's /props, else 131072)",
        None,
        metavar="N",
    ),
    Option(
        "stats_retention_s",
        int,
        "how long statistics are kept, seconds",
        7 * 24 * 3600,
        metavar="S",
    ),
    Option(
        "policy",
        str,
        "how requests are spread over several backends: " + ", ".join(POLICIES),
        "prefix-affinity",
    ),
    Option(
        "min_affinity_blocks",
        int,
        "prefix-affinity: blocks a replica must hold beyond the prefix most traffic shares "
        "before the request follows it",
        2,
        metavar="N",
    ),
    Option(
        "load_gate_ratio",
        float,
        "prefix-affinity: a replica loaded above RATIO x the fleet mean (plus 2 requests) "
        "loses its affinity traffic to the least loaded replica",
        1.5,
        metavar="RATIO",
    ),
    Option(
        "load_gate_slack",
        float,
        "prefix-affinity: requests added to the load gate's limit, so a nearly idle fleet "
        "never gates",
        2.0,
        metavar="N",
    ),
    Option(
        "shared_share",
        float,
        "prefix-affinity: a leading block carried by at least this share of recent requests is "
        "shared by most traffic and never counts as affinity",
        0.5,
        metavar="SHARE",
    ),
    Option(
        "min_window_requests",
        int,
        "prefix-affinity: below this many requests in the traffic window no block counts as shared",
        16,
        metavar="N",
    ),
    Option(
        "traffic_window_s",
        float,
        "prefix-affinity: bucket length of the recent-traffic counts, seconds (a read covers "
        "one to two buckets)",
        120.0,
        metavar="S",
    ),
    Option(
        "health_interval_s",
        float,
        "seconds between health checks of each backend (and reads of its own load)",
        2.0,
        metavar="S",
    ),
    Option(
        "health_failures",
        int,
        "consecutive failed health checks that eject a backend until it passes again",
        3,
        metavar="N",
    ),
    Option("health_timeout_s", float, "seconds a health check may take", 2.0, metavar="S"),
    Option(
        "backend_load",
        _bool,
        "route with each backend's own load too (llama.cpp /slots or /metrics, vLLM /metrics), "
        "read on the health-check interval",
        True,
        is_flag=True,
    ),
    Option(
        "slot_scheduling",
        str,
        "llama.cpp: pin requests sharing a prefix to the slot that holds it (id_slot): "
        "auto (on, but off on a replica while other traffic reaches it), on, off",
        "auto",
        metavar="MODE",
    ),
    Option(
        "coalesce",
        _bool,
        "vLLM and other shared-cache servers: hold a request until an in-flight request "
        "prefilling its prefix has its first token",
        True,
        metavar="on|off",
    ),
    Option(
        "coalesce_max_wait_ms",
        float,
        "longest a request is held for another one's prefill",
        2000.0,
        metavar="MS",
    ),
    Option(
        "fanout",
        _bool,
        "llama.cpp with --slot-save-path: copy a busy slot's prefix into an idle slot so "
        "requests sharing it decode in parallel",
        False,
        metavar="on|off",
    ),
    Option(
        "server_slot_similarity",
        float,
        "llama.cpp: the --slot-prompt-similarity the replicas run with (their default 0.10; 0 "
        "makes them restore conversations from their RAM cache): the cache model follows it",
        0.1,
        metavar="F",
    ),
    Option(
        "server_kv_unified",
        str,
        "llama.cpp: whether the replicas run with a unified KV cache (their default without -np): "
        "auto (learned from /slots), on, off",
        "auto",
        metavar="MODE",
    ),
    Option(
        "canonicalize",
        _bool,
        "rewrite prompts so stable segments come first (--no-canonicalize turns it off)",
        True,
        is_flag=True,
    ),
    Option(
        "canonical_dry_run",
        _bool,
        "compute and record canonicalization, forward the original",
        False,
        is_flag=True,
    ),
    Option(
        "admin_token",
        str,
        "bearer token required on the admin listener's /stats, /dashboard and /metrics",
    ),
    Option(
        "api_key",
        str,
        "client API key the proxy requires as 'Authorization: Bearer KEY' (repeat for several)",
        repeat=True,
        metavar="KEY",
    ),
    Option(
        "api_keys_file",
        str,
        "file of client API keys, one 'KEY [TENANT]' per line",
        metavar="PATH",
    ),
    Option(
        "passthrough",
        str,
        "what the proxy forwards besides chat, completions and /completion: all (every other "
        "path and method), read-only (GET, HEAD and OPTIONS only) or off (nothing: 404)",
        "all",
        metavar="MODE",
    ),
    Option(
        "tenant_header",
        str,
        "request header naming the tenant (refines the key's tenant when keys are set)",
        metavar="NAME",
    ),
    Option(
        "session_header",
        str,
        "request header read as the conversation's routing key when the body has no "
        f"prompt_cache_key (repeat; default {', '.join(DEFAULT_SESSION_HEADERS)}; "
        "'none' for no header)",
        repeat=True,
        metavar="NAME",
    ),
    Option(
        "strip_hosted_fields",
        str,
        "dialects whose requests lose hosted-only fields (prompt_cache_key, "
        "prompt_cache_retention, safety_identifier, service_tier, store, metadata) "
        f"before they go upstream (repeat; default {', '.join(DEFAULT_STRIP_DIALECTS)}; "
        "'none' for no dialect)",
        repeat=True,
        metavar="DIALECT",
    ),
    Option(
        "redact_pattern",
        str,
        "extra regular expression redacted from logged prompt text (repeat; env: one per line)",
        repeat=True,
        metavar="REGEX",
        sep="\n",
    ),
    Option(
        "redact_defaults",
        _bool,
        "redact API keys, tokens and emails from logged prompt text (--log-prompts)",
        True,
        is_flag=True,
    ),
)
_BY_NAME = {o.name: o for o in OPTIONS}


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
        shown = f"; default {opt.default}" if opt.default not in (None, False) else ""
        kwargs: dict[str, Any] = {"dest": opt.name, "default": argparse.SUPPRESS}
        if opt.is_flag:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = opt.metavar
        if opt.repeat:
            kwargs["action"] = "append"
            shown = ", comma-separated" if opt.sep == "," else ", one per line"
        parser.add_argument(opt.cli, help=f"{opt.help} ({env}{shown})", **kwargs)


def _parse_backend(text: str) -> BackendSpec:
    url, _, weight = text.strip().partition("=")
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"backend URL must start with http:// or https://: {text!r}")
    return BackendSpec(url=url, weight=float(weight) if weight else 1.0)


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


def _repeated(opt: Option, raw: Any) -> tuple[Any, ...]:
    """A repeated option's values: a list (flags, TOML) or one separated string (environment)."""
    items = raw if isinstance(raw, list | tuple) else str(raw).split(opt.sep)
    return tuple(opt.cast(v) for v in items if str(v).strip())


def _listen_hosts(values: tuple[str, ...]) -> tuple[str, ...]:
    """Listen addresses, each once, in the order given (a ``[::1]`` bracket form is unwrapped)."""
    out: list[str] = []
    for value in values:
        for part in value.split(","):
            host = part.strip()
            if host.startswith("[") and host.endswith("]"):
                host = host[1:-1]
            if host and host not in out:
                out.append(host)
    if not out:
        raise ConfigError("--host needs at least one address")
    return tuple(out)


def _fleet_settings(values: Mapping[str, Any]) -> tuple[RoutingConfig, HealthChecks]:
    """Routing and health-check settings, validated (``ConfigError`` on a bad value)."""
    try:
        routing = RoutingConfig(
            policy=values["policy"],
            min_affinity_blocks=values["min_affinity_blocks"],
            load_gate_ratio=values["load_gate_ratio"],
            load_gate_slack=values["load_gate_slack"],
            shared_share=values["shared_share"],
            min_window_requests=values["min_window_requests"],
        )
    except ValueError as exc:
        raise ConfigError(f"bad routing setting: {exc}") from exc
    health = HealthChecks(
        interval_s=values["health_interval_s"],
        failures=values["health_failures"],
        timeout_s=values["health_timeout_s"],
        backend_load=values["backend_load"],
    )
    if not health.interval_s > 0 or not health.timeout_s > 0:
        raise ConfigError("--health-interval-s and --health-timeout-s must be positive")
    if health.failures < 1:
        raise ConfigError("--health-failures must be at least 1")
    if not (math.isfinite(values["traffic_window_s"]) and values["traffic_window_s"] > 0):
        raise ConfigError("--traffic-window-s must be a positive number")
    return routing, health


def _names(value: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    """A repeated list of names: the default when unset, nothing for 'none'."""
    if value is None:
        return default
    names = tuple(str(v).strip().lower() for v in value if str(v).strip())
    return () if names == ("none",) else names


def _hosted_settings(values: Mapping[str, Any]) -> HostedFields:
    """Conversation-key headers and the dialects that lose hosted fields."""
    headers = _names(values["session_header"], DEFAULT_SESSION_HEADERS)
    dialects = _names(values["strip_hosted_fields"], DEFAULT_STRIP_DIALECTS)
    unknown = [d for d in dialects if d not in DIALECTS or d == "auto"]
    if unknown:
        raise ConfigError(
            f"--strip-hosted-fields takes dialects ({', '.join(DIALECTS[1:])}) or none, "
            f"not {', '.join(unknown)}"
        )
    return HostedFields(session_headers=headers, strip_dialects=dialects)


def _scheduling_settings(values: Mapping[str, Any]) -> SchedulingConfig:
    """Slot scheduling, coalescing and fan-out settings (``ConfigError`` on a bad value)."""
    if values["slot_scheduling"] not in SLOT_MODES:
        raise ConfigError(f"--slot-scheduling must be one of {', '.join(SLOT_MODES)}")
    try:
        return SchedulingConfig(
            slot_scheduling=values["slot_scheduling"],
            coalesce=values["coalesce"],
            coalesce_max_wait_ms=values["coalesce_max_wait_ms"],
            fanout=values["fanout"],
            server_slot_similarity=values["server_slot_similarity"],
            server_kv_unified=values["server_kv_unified"],
        )
    except ValueError as exc:
        raise ConfigError(f"bad scheduling setting: {exc}") from exc


def resolve(
    args: Mapping[str, Any] | argparse.Namespace,
    *,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build the one ``Settings`` object from flags, environment and TOML file."""
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
            if opt.name == "backend":
                values[opt.name] = _backends(raw)
            elif opt.repeat:
                values[opt.name] = _repeated(opt, raw)
            else:
                values[opt.name] = opt.cast(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad value for {opt.cli}: {raw!r} ({exc})") from exc

    backends = values.pop("backend") or ()
    if not backends:
        raise ConfigError(f"no backend configured: pass --backend URL or set {ENV_PREFIX}BACKEND")
    if any(not b.weight > 0 for b in backends):
        raise ConfigError("a backend weight must be a positive number (URL=WEIGHT)")
    if len({b.url for b in backends}) != len(backends):
        raise ConfigError("the same backend URL is configured twice")
    if values["dialect"] not in DIALECTS:
        raise ConfigError(f"--dialect must be one of {', '.join(DIALECTS)}")
    if values["block_bytes"] < 16:
        raise ConfigError("--block-bytes must be at least 16")
    routing, health = _fleet_settings(values)
    if values["passthrough"] not in PASSTHROUGH_MODES:
        raise ConfigError(f"--passthrough must be one of {', '.join(PASSTHROUGH_MODES)}")
    hosts = _listen_hosts(values["host"] or ("127.0.0.1",))
    admin_hosts = _listen_hosts(values["admin_host"]) if values["admin_host"] else None
    if not 0 <= values["port"] <= 65535 or not 0 <= values["admin_port"] <= 65535:
        raise ConfigError("--port and --admin-port must be between 0 and 65535")
    if values["port"] and values["port"] == values["admin_port"]:
        raise ConfigError(
            "--admin-port must differ from --port: the admin routes live apart from the "
            "backend's paths"
        )
    return Settings(
        backends=tuple(backends),
        hosts=hosts,
        port=values["port"],
        admin_hosts=admin_hosts,
        admin_port=values["admin_port"],
        dialect=values["dialect"],
        backend_api_key=values["backend_api_key"],
        redis_url=values["redis_url"],
        log_file=values["log_file"],
        log_level=values["log_level"],
        log_prompts=values["log_prompts"],
        max_body_bytes=values["max_body_bytes"],
        timeouts=Timeouts(
            connect=values["connect_timeout"],
            idle=values["idle_timeout"],
            store=values["store_timeout"],
            client=values["client_timeout"],
        ),
        slo=Slo(ttft_ms=values["slo_ttft_ms"], tpot_ms=values["slo_tpot_ms"]),
        pricing=Pricing(
            input_per_mtok=values["price_input_per_mtok"],
            cached_input_per_mtok=values["price_cached_input_per_mtok"],
        ),
        routing=routing,
        health=health,
        scheduling=_scheduling_settings(values),
        block_bytes=values["block_bytes"],
        capacity_tokens=values["capacity_tokens"],
        stats_retention_s=values["stats_retention_s"],
        traffic_window_s=values["traffic_window_s"],
        canonicalize=values["canonicalize"],
        canonical_dry_run=values["canonical_dry_run"],
        canonical=dict(toml.get("canonical", {})),
        admin_token=values["admin_token"],
        api_keys=values["api_key"] or (),
        api_keys_file=values["api_keys_file"],
        tenant_header=values["tenant_header"],
        hosted=_hosted_settings(values),
        passthrough=values["passthrough"],
        redact_patterns=values["redact_pattern"] or (),
        redact_defaults=values["redact_defaults"],
        config_file=str(config_path) if config_path else None,
    )
