"""Starting a real llama-server with the SmolLM2 model for integration tests.

Missing pieces fail the test run with a message saying how to install them: these tests are
never skipped (CI must not pass without having run them).
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from deploy import local_llama
from tests.ports import free_port


def llama_server_binary() -> str:
    """The installed llama-server; fails the test run when it is missing."""
    try:
        return local_llama.llama_server_binary()
    except local_llama.MissingPiece as exc:
        pytest.fail(str(exc))


def smollm2_model() -> str:
    """The installed SmolLM2 model file; fails the test run when it is missing."""
    try:
        return local_llama.smollm2_model()
    except local_llama.MissingPiece as exc:
        pytest.fail(str(exc))


@contextmanager
def running_llama_server(
    *,
    slots: int = 2,
    ctx: int = 8192,
    threads: int = 2,
    metrics: bool = True,
    extra: Sequence[str] = (),
    log_path: Path | None = None,
) -> Iterator[str]:
    """A llama-server on a free port; yields its base URL; stops it afterwards.

    ``threads``: llama.cpp's compute threads spin, so several servers sharing the machine must
    split its cores between them, or every one of them crawls. ``metrics``: start it with
    ``--metrics``; ``extra``: more of its flags; ``log_path``: where its log goes (a test that
    reads it), else ``$LLAMA_SERVER_LOG`` or nowhere.
    """
    port = free_port()
    log_to = log_path or os.environ.get("LLAMA_SERVER_LOG", os.devnull)
    log = open(log_to, "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            llama_server_binary(),
            "-m",
            smollm2_model(),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            str(ctx),
            "-np",
            str(slots),
            "-t",
            str(threads),
            *(["--metrics"] if metrics else []),
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited with {proc.returncode} at start-up")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("llama-server did not become healthy within 120 s")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
