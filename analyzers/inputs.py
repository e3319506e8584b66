"""Where the analyzer's inputs come from: files as they lie on disk, compressed or not, and
directories of them.

A file is decompressed when it starts with the gzip or the xz magic bytes, whatever its name
(a rotated log may have lost its suffix). A directory stands for every file below it whose name
looks like a log or a trace (``is_input_name``), so ``prefixgate analyze logs/`` reads a
rotated, compressed log directory as it is, and a README or a license beside the traces is left
alone.
"""

from __future__ import annotations

import gzip
import io
import lzma
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

_GZIP_MAGIC = b"\x1f\x8b"
_XZ_MAGIC = b"\xfd7zXZ\x00"
COMPRESSED_SUFFIXES = (".gz", ".xz")
INPUT_SUFFIXES = frozenset({".jsonl", ".json", ".ndjson", ".log"})
# io.BufferedReader's C readline over the decompressor: iterating lzma/gzip file objects
# directly goes through a Python-level readline per line (+25 % read time on a trace).
_DECOMPRESSED_BUFFER = 1 << 20


def _decompressor(path: Path) -> Callable[[Path], io.BufferedIOBase] | None:
    """How to open ``path`` decompressed, told by its magic bytes; None when it is plain."""
    with path.open("rb") as fh:
        head = fh.read(len(_XZ_MAGIC))
    if head.startswith(_GZIP_MAGIC):
        return lambda p: gzip.open(p, "rb")
    if head == _XZ_MAGIC:
        return lambda p: lzma.open(p, "rb")
    return None


def is_compressed(path: Path) -> bool:
    """Whether ``path`` is gzip or xz, by its first bytes."""
    return _decompressor(path) is not None


def open_input(path: Path) -> IO[bytes]:
    """``path`` opened for reading bytes, decompressed on the fly when gzip or xz."""
    decompressed = _decompressor(path)
    if decompressed is None:
        return path.open("rb")
    return io.BufferedReader(decompressed(path), _DECOMPRESSED_BUFFER)


def read_input(path: Path) -> bytes:
    """The whole content of ``path``, decompressed when gzip or xz."""
    with open_input(path) as fh:
        return fh.read()


def input_stem(path: Path) -> str:
    """The file's name without its compression suffix and its format suffix."""
    name = Path(path.name)
    if name.suffix in COMPRESSED_SUFFIXES:
        name = Path(name.stem)
    return name.stem


def is_input_name(name: str) -> bool:
    """Whether a file name looks like an input: ``.jsonl``, ``.json``, ``.ndjson`` or ``.log``,
    then optionally a rotation number (``requests.jsonl.3``) and ``.gz`` or ``.xz``."""
    if name.startswith("."):
        return False
    parts = name.split(".")[1:]
    if parts and "." + parts[-1] in COMPRESSED_SUFFIXES:
        parts.pop()
    if parts and parts[-1].isdigit():
        parts.pop()
    return bool(parts) and "." + parts[-1] in INPUT_SUFFIXES


def input_files(paths: Iterable[Path]) -> list[Path]:
    """Files given as they are; a directory as every input file below it, in name order.

    Hidden files and folders are left out, and so is what does not look like an input by its
    name (``is_input_name``): a README or a license beside the traces. A file named twice is
    read once.
    """
    out: dict[Path, None] = {}
    for path in paths:
        if path.is_dir():
            found = (
                p
                for p in sorted(path.rglob("*"))
                if p.is_file()
                and is_input_name(p.name)
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            out.update(dict.fromkeys(found))
        else:
            out[path] = None
    return list(out)
