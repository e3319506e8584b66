"""`make run`'s supervisor (deploy/run_local.py): whatever stops it stops llama-server and the
proxy with it. llama-server is played by the fake llama.cpp backend behind llama-server's
command line, so the real binary is not needed."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.reliability.processes import REPO, ChildProcess

RUN_LOCAL = REPO / "deploy" / "run_local.py"
FAKE_LLAMA_SERVER = """#!{python}
# llama-server's command line in front of the fake llama.cpp backend.
import sys
sys.path.insert(0, {repo!r})
from tests.reliability.fake_backend import main
args = sys.argv[1:]
main(["--port", args[args.index("--port") + 1]])
"""


class Stack:
    """run_local.py in front of the fake llama-server, with the servers it started."""

    def __init__(self, tmp_path: Path) -> None:
        fake = tmp_path / "llama-server"
        fake.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, repo=str(REPO)))
        fake.chmod(0o755)
        self.port, self.llama_port = free_port(), free_port()
        argv = [sys.executable, str(RUN_LOCAL), "--port", str(self.port)]
        argv += ["--llama-port", str(self.llama_port), "--llama-server", str(fake)]
        argv += ["--model", "unused.gguf", "--log-file", str(tmp_path / "requests.jsonl")]
        self.supervisor = ChildProcess(argv, name="run_local", workdir=tmp_path)
        self.servers: list[int] = []

    def start(self) -> None:
        self.supervisor.spawn()
        # Through the proxy to the backend: both servers are up.
        self.supervisor.wait_http(f"http://127.0.0.1:{self.port}/v1/models", timeout_s=60)
        pid = self.supervisor.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        # llama-server first, as run_local.py starts them.
        self.servers = sorted(map(int, children), key=lambda c: b"proxy.cli" in cmdline(c))
        assert len(self.servers) == 2

    def close(self) -> None:
        for pid in self.servers:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        self.supervisor.kill()


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    running_stack = Stack(tmp_path)
    try:
        running_stack.start()
        yield running_stack
    finally:
        running_stack.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_stops_both_servers(stack: Stack, sig: signal.Signals) -> None:
    """SIGTERM (a supervisor, `kill`), SIGINT (Ctrl-C) or SIGHUP: llama-server and the proxy
    exit, their ports close, and run_local.py exits 0."""
    assert stack.supervisor.proc is not None
    stack.supervisor.proc.send_signal(sig)
    assert stack.supervisor.proc.wait(timeout=45) == 0
    assert [pid for pid in stack.servers if running(pid)] == []
    assert not listening(stack.port) and not listening(stack.llama_port)


def test_a_server_that_dies_takes_the_other_down(stack: Stack) -> None:
    """llama-server killed under the proxy: the proxy is stopped too, and the exit status says
    how llama-server died."""
    llama, proxy = stack.servers
    os.kill(llama, signal.SIGKILL)
    assert stack.supervisor.proc is not None
    assert stack.supervisor.proc.wait(timeout=45) == 128 + signal.SIGKILL
    assert not running(proxy) and not listening(stack.port)
