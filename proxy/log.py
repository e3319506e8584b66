"""structlog, configured once: JSON lines, the request id bound per request.

Records and operational events share one stream (stdout, or ``--log-file``), one JSON object a
line; records are the lines with ``"event": "request"``. Calls are synchronous: a JSON line is
cheaper than handing it to another thread, and records are written after the response has ended.
A record, one per request, is written by ``info_line``: the same line, without the processor
chain (a third of the cost).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, cast

import orjson
import structlog

from proxy.timestamps import iso_us

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
LOG_LEVELS = tuple(_LEVELS)
"""The levels ``--log-level`` takes."""
_open_files: list[BinaryIO] = []


def _dumps(obj: Any, **_: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS, default=str)


def configure_logging(*, level: str = "info", log_file: str | None = None) -> None:
    """Configure structlog for the whole process (call once, at start-up)."""
    for f in _open_files:
        f.close()
    _open_files.clear()
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        out = cast(BinaryIO, open(log_file, "ab", buffering=0))  # noqa: SIM115 - process-long
        _open_files.append(out)
    else:
        out = cast(BinaryIO, sys.stdout.buffer)
    global _lines
    factory = structlog.BytesLoggerFactory(out)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="logged_at"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )
    info = _LEVELS.get(level, logging.INFO) <= logging.INFO
    config = structlog.get_config()
    _lines = (
        (config["logger_factory"], tuple(config["processors"]), config["wrapper_class"], out)
        if info
        else None
    )


_lines: tuple[Any, tuple[Any, ...], Any, BinaryIO] | None = None
"""The factory, processors, wrapper and stream ``configure_logging`` installed (``info_line``)."""
_held: list[bytes] | None = None
"""The lines ``info_line`` wrote inside ``lines_held``, not out yet."""


@contextmanager
def lines_held() -> Iterator[None]:
    """The lines ``info_line`` writes within go out together at the end, in one write (the
    records of a batch: ``RecordWriter``)."""
    global _held
    if _held is not None:  # (nested: the outer one writes them)
        yield
        return
    _held = []
    try:
        yield
    finally:
        held, _held = _held, None
        if held and _lines is not None:
            out = _lines[3]
            out.write(b"".join(held))
            out.flush()


def info_line(event: str, fields: dict[str, Any]) -> bool:
    """Write ``fields`` as one info line of ``event``, exactly as ``log.info(event, **fields)``
    would with the configuration of ``configure_logging`` (the request's bound context, the
    level, the timestamp), without structlog's processor chain: a record is written per
    request. False (nothing written) when that configuration is not the one in force (a test
    capturing the logs, info lines filtered out): the caller logs through structlog then.
    """
    lines = _lines
    if lines is None:
        return False
    config = structlog.get_config()
    if (
        config["logger_factory"] is not lines[0]
        or config["wrapper_class"] is not lines[2]
        or tuple(config["processors"]) != lines[1]  # a capture edits the list in place
    ):
        return False
    fields["event"] = event
    for key, value in structlog.contextvars.get_contextvars().items():
        fields.setdefault(key, value)
    fields["level"] = "info"
    fields["logged_at"] = iso_us(time.time_ns())
    line = _dumps(fields) + b"\n"
    if _held is not None:
        _held.append(line)
        return True
    out = lines[3]
    out.write(line)
    out.flush()  # as structlog's logger does: stdout is buffered
    return True


def get_logger(name: str = "prefixgate") -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger
