"""Running examples/ scripts from the tests, and the live proxy they talk to.

Python examples run in a worker thread via ``runpy`` (as ``__main__``, with their own argv) so the
test's event loop keeps serving the proxy while they block; shell examples run as subprocesses.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import runpy
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from fakes import LlamaFake

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclass(frozen=True, slots=True)
class LiveProxy:
    """A listening proxy: its OpenAI base URL, its root URL, its admin URL and the fake."""

    base_url: str
    root_url: str
    fake: LlamaFake
    admin_url: str = ""


StartProxy = Callable[..., Awaitable[LiveProxy]]


@dataclass(frozen=True, slots=True)
class Run:
    """What an example printed and how it exited."""

    code: int
    out: str


def _run_in_thread(script: Path, argv: list[str]) -> Run:
    out = io.StringIO()
    saved = sys.argv
    sys.argv = [str(script), *argv]
    code = 0
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return Run(code, out.getvalue())


async def run_python_example(name: str, *argv: str, limit_s: float = 60.0) -> Run:
    """Run ``examples/<name>`` as ``__main__`` with ``argv`` while the loop keeps serving."""
    async with asyncio.timeout(limit_s):
        return await asyncio.to_thread(_run_in_thread, EXAMPLES / name, list(argv))


async def run_subprocess(
    *cmd: str, env: dict[str, str] | None = None, limit_s: float = 60.0
) -> Run:
    """Run a command to completion (stderr folded into the output)."""
    proc = await asyncio.create_subprocess_exec(
        *cmd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    async with asyncio.timeout(limit_s):
        out, _ = await proc.communicate()
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode())
