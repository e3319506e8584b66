"""How a setting is declared: once, on the dataclass field that holds it.

``option(default, help, ...)`` is a ``dataclasses.field`` whose metadata is the option's one
declaration; ``group(cls, ...)`` nests a settings value object (``Timeouts``, ``RoutingConfig``...)
in ``Settings`` and says how its fields' options are named. ``collect(Settings)`` walks them and
returns every ``Option`` in declaration order; from each one come the command-line flag, the
``PREFIXGATE_*`` environment variable, the TOML key, the dataclass default (the same value, by
construction) and its row in the option reference (``options_markdown``). ``proxy.config``
resolves them; this module imports nothing of the proxy, so any value object can declare its
options without an import running back up the house.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "PREFIXGATE_"
_OPTION = "prefixgate.option"
_GROUP = "prefixgate.group"


class ConfigError(Exception):
    """A setting is missing or has a value that cannot be used."""


# -- casts: text (an environment variable, a flag) or a TOML value into the setting's type ------


def to_bool(value: Any) -> bool:
    """A boolean from ``true``/``false``, ``on``/``off``, ``yes``/``no``, ``1``/``0``."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {value!r}")


def to_opt_float(value: Any) -> float | None:
    """A number, or None for ``off`` / ``none`` / empty."""
    if value is None or (isinstance(value, str) and value.strip().lower() in {"", "none", "off"}):
        return None
    return float(value)


def to_size(value: Any) -> int:
    """Bytes, accepting suffixes k/m/g (binary)."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": 1024, "m": 1024**2, "g": 1024**3}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def to_lower(value: Any) -> str:
    """A name compared case-insensitively (a log level, a mode)."""
    return str(value).strip().lower()


def split_items(raw: Any, sep: str) -> tuple[Any, ...]:
    """A repeated option's items: a list (flags, TOML) or one ``sep``-separated string (the
    environment); blank items are dropped."""
    if raw is None:
        return ()
    items = raw if isinstance(raw, list | tuple) else str(raw).split(sep)
    return tuple(v for v in items if str(v).strip())


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its flag, environment variable, TOML key, type, default and help."""

    name: str
    """The TOML key; the flag and the environment variable are made from it."""
    cast: Callable[[Any], Any]
    help: str
    default: Any = None
    metavar: str | None = None
    is_flag: bool = False
    """A switch: ``--name`` / ``--no-name`` on the command line."""
    repeat: bool = False
    """Given several times (flags, a TOML array) or separated by ``sep`` (environment)."""
    sep: str = ","
    """How a repeated option's environment variable separates its values."""
    choices: tuple[str, ...] = ()
    """The values it takes (each value, for a repeated option); empty: any."""
    parse: Callable[[Any], Any] | None = None
    """Turns the whole raw value (all repeats) into the setting; instead of ``cast`` per item."""
    path: tuple[str, ...] = ()
    """Where it lands in ``Settings``: a field, or a group's field and the group's field."""

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def cli(self) -> str:
        return "--" + self.name.replace("_", "-")


def option(
    default: Any,
    help: str,
    *,
    cast: Callable[[Any], Any] = str,
    name: str | None = None,
    metavar: str | None = None,
    is_flag: bool = False,
    repeat: bool = False,
    sep: str = ",",
    choices: Sequence[str] = (),
    parse: Callable[[Any], Any] | None = None,
) -> Any:
    """A dataclass field that is also a setting; ``name`` when the option is not the field's."""
    declared = Option(
        name=name or "",
        cast=cast,
        help=help,
        default=default,
        metavar=metavar,
        is_flag=is_flag,
        repeat=repeat,
        sep=sep,
        choices=tuple(choices),
        parse=parse,
    )
    return field(default=default, metadata={_OPTION: declared})


@dataclass(frozen=True, slots=True)
class _Group:
    cls: type
    prefix: str
    suffix: str
    label: str
    options: Mapping[str, Any]


def group(
    cls: type,
    *,
    prefix: str = "",
    suffix: str = "",
    label: str = "",
    options: Mapping[str, Any] | None = None,
) -> Any:
    """A ``Settings`` field holding a value object whose fields are options.

    An option's name is ``prefix + field + suffix`` unless its declaration names it. ``options``
    declares the settings of a value object that has no declarations of its own (its defaults
    mean "none": ``Slo()`` has no objective); the default of the ``Settings`` field is then built
    from those declarations. ``label`` names the group in a validation error.
    """
    declared = dict(options or {})
    spec = _Group(cls, prefix, suffix, label, declared)

    def default() -> Any:
        return cls(**{k: v.metadata[_OPTION].default for k, v in declared.items()})

    return field(default_factory=default if declared else cls, metadata={_GROUP: spec})


def _bind(
    f: dataclasses.Field[Any], key: str, *, prefix: str, suffix: str, path: tuple[str, ...]
) -> Option:
    declared: Option = f.metadata[_OPTION]
    name = declared.name or prefix + key + suffix
    return dataclasses.replace(declared, name=name, path=path)


def collect(settings_cls: type) -> tuple[Option, ...]:
    """Every option declared on ``settings_cls`` and its groups, in declaration order."""
    out: list[Option] = []
    for f in dataclasses.fields(settings_cls):
        if _OPTION in f.metadata:
            out.append(_bind(f, f.name, prefix="", suffix="", path=(f.name,)))
        elif _GROUP in f.metadata:
            spec: _Group = f.metadata[_GROUP]
            inner = (
                list(spec.options.items())
                if spec.options
                else [(g.name, g) for g in dataclasses.fields(spec.cls)]
            )
            for key, g in inner:
                if _OPTION in g.metadata:
                    path = (f.name, key)
                    out.append(_bind(g, key, prefix=spec.prefix, suffix=spec.suffix, path=path))
    names = [o.name for o in out]
    if len(set(names)) != len(names):
        raise RuntimeError(f"an option is declared twice: {sorted(names)}")
    return tuple(out)


def groups(settings_cls: type) -> dict[str, tuple[type, str]]:
    """The group fields of ``settings_cls``: field name -> (value class, label)."""
    out: dict[str, tuple[type, str]] = {}
    for f in dataclasses.fields(settings_cls):
        if _GROUP in f.metadata:
            spec: _Group = f.metadata[_GROUP]
            out[f.name] = (spec.cls, spec.label)
    return out


# -- the reference ------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(opt: Option) -> str:
    value: Any = opt.default
    if value is None or value == ():
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple | list):
        return ", ".join(f"`{v}`" for v in value)
    return f"`{value}`"


def _flag(opt: Option) -> str:
    if opt.is_flag:
        return f"`{opt.cli}` / `--no-{opt.cli[2:]}`"
    metavar = opt.metavar or opt.name.upper()  # the placeholder argparse shows
    if "|" in metavar:
        # Alternatives, one code span each: GitHub splits a table row on every pipe, code or not,
        # and Python-Markdown keeps the backslash of an escaped one inside code.
        first, *rest = metavar.split("|")
        return ", ".join([f"`{opt.cli} {first}`", *(f"`{alt}`" for alt in rest)])
    return f"`{opt.cli} {metavar}`"


def _meaning(opt: Option) -> str:
    text = opt.help
    if opt.choices:
        text += f" (one of: {', '.join(opt.choices)})"
    if opt.repeat:
        text += "; repeatable" + ("" if opt.sep == "," else " (environment: one per line)")
    return _cell(text)


def options_markdown(options: Sequence[Option], *, header: str) -> str:
    """The option reference as Markdown: ``header`` (ending with the table's first rows), then
    one row per option with its flag, variable, TOML key, default and meaning."""
    rows = [
        f"| {_cell(_flag(o))} | `{o.env}` | `{o.name}` | {_cell(_default(o))} | {_meaning(o)} |"
        for o in options
    ]
    return header + "\n".join(rows) + "\n"
