"""Real processes for fault tests and the soak: the proxy, fake backends, a TCP gate.

Faults are injected the way they happen in production: a backend process is SIGKILLed and
started again on the same port, Redis is killed or stops answering, a client stops reading. So
the proxy under test runs as its own ``prefixgate serve`` process (its memory can be measured
and nothing it does shares the test's event loop), and so do the fake backends
(``tests/reliability/fake_backend.py``).

``TcpGate`` is a TCP forwarder the test controls: ``block()`` turns it into a blackhole (it keeps
accepting connections and reading nothing, so every request through it hangs), ``unblock()``
lets the traffic flow again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def raise_nofile(want: int) -> int:
    """Raise this process's open-file limit towards ``want`` (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """A blocking GET: (status, body); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, TimeoutError):
        return 0, b""


async def eventually(
    check: Callable[[], Awaitable[bool]], *, within_s: float, every_s: float = 0.1
) -> bool:
    """Poll ``check`` until it holds (True) or ``within_s`` has passed (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        if await check():
            return True
        if loop.time() > deadline:
            return False
        await asyncio.sleep(every_s)


class ChildProcess:
    """A child process with its output in a file; started, killed, restarted by the caller."""

    def __init__(self, argv: Sequence[str], *, name: str, workdir: Path | None = None) -> None:
        self.argv = list(argv)
        self.name = name
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix=f"pg-{name}-"))
        self.output = self.workdir / f"{name}.out"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} is not running"
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.output, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def wait_http(self, url: str, timeout_s: float = 20.0) -> None:
        """Wait until ``url`` answers 200, or fail with the process's output."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited:\n{self.output_tail()}")
            if http_get(url, timeout_s=1.0)[0] == 200:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer {url}:\n{self.output_tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL (a crash: no cleanup, sockets closed by the kernel) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit within 5 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def remove_files(self) -> None:
        """Delete the working directory (output, logs); the process must be stopped."""
        shutil.rmtree(self.workdir, ignore_errors=True)

    def output_tail(self, limit: int = 4000) -> str:
        try:
            return self.output.read_bytes()[-limit:].decode("utf-8", "replace")
        except OSError:
            return ""


class FakeBackendProcess(ChildProcess):
    """``tests/reliability/fake_backend.py`` on a fixed port (so it can come back on it)."""

    def __init__(self, *, port: int | None = None, dialect: str = "llamacpp") -> None:
        self.port = port or free_port()
        self.admin_port = free_port()
        argv = [sys.executable, "-m", "tests.reliability.fake_backend", "--port", str(self.port)]
        super().__init__([*argv, "--dialect", dialect], name=f"backend-{self.port}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeBackendProcess:
        self.spawn()
        self.wait_http(self.url + "/health")
        return self

    def stats(self) -> dict[str, Any]:
        """The fake's counters (requests, finished, closed, active, flood_bytes)."""
        status, body = http_get(self.url + "/_fault/stats")
        assert status == 200, f"{self.name} stats: {status}"
        stats: dict[str, Any] = orjson.loads(body)
        return stats

    def last_body(self) -> bytes:
        """The body of the last inference request the fake received, byte for byte."""
        status, body = http_get(self.url + "/_fault/last")
        assert status == 200, f"{self.name} last: {status}"
        return body


class ProxyProcess(ChildProcess):
    """``prefixgate serve`` as a process, records and events in its own log file."""

    def __init__(
        self,
        backends: Sequence[str],
        *,
        redis_url: str | None = None,
        connect_timeout: float = 1.0,
        idle_timeout: float = 1.0,
        store_timeout: float = 0.005,
        client_timeout: float | None = None,
        max_body_bytes: int | None = None,
        extra: Sequence[str] = (),
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.admin_port = free_port()
        name = f"proxy-{self.port}"
        workdir = Path(tempfile.mkdtemp(prefix=f"pg-{name}-"))
        self.log_file = workdir / "records.jsonl"
        argv = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(self.port)]
        argv += ["--admin-port", str(self.admin_port)]
        for url in backends:
            argv += ["--backend", url]
        argv += ["--log-file", str(self.log_file), "--connect-timeout", str(connect_timeout)]
        argv += ["--idle-timeout", str(idle_timeout), "--store-timeout", str(store_timeout)]
        if redis_url:
            argv += ["--redis-url", redis_url]
        if client_timeout is not None:
            argv += ["--client-timeout", str(client_timeout)]
        if max_body_bytes is not None:
            argv += ["--max-body-bytes", str(max_body_bytes)]
        super().__init__([*argv, *extra], name=name, workdir=workdir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        """The admin listener: /healthz, /readyz, /stats, /metrics, /dashboard."""
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self) -> ProxyProcess:
        self.spawn()
        self.wait_http(self.admin_url + "/healthz")
        return self

    def log_lines(self) -> list[dict[str, Any]]:
        """Every JSON line the proxy has written so far (records and operational events)."""
        if not self.log_file.exists():
            return []
        out: list[dict[str, Any]] = []
        for line in self.log_file.read_bytes().splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):
                out.append(orjson.loads(line))
        return out

    def records(self) -> list[dict[str, Any]]:
        return [e for e in self.log_lines() if e.get("event") == "request"]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.log_lines() if e.get("event") == name]

    def rss(self) -> int:
        return rss_bytes(self.pid)


class TcpGate:
    """A TCP forwarder to ``127.0.0.1:target``; ``block()`` turns it into a blackhole."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._closed = False

    async def start(self) -> TcpGate:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def block(self) -> None:
        """Stop forwarding in both directions; connections stay open, bytes wait."""
        self._open.clear()

    def unblock(self) -> None:
        self._open.set()

    async def close(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.close()
        # Connections the server took just before closing get their handler on the next turns
        # of the loop: let them start (so they are tracked), then stop everything.
        for _ in range(3):
            await asyncio.sleep(0)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self._writers:  # after the tasks: a connection accepted meanwhile is here too
            w.transport.abort()  # not close(): it waits to flush to a peer that may not read
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)  # closed by close() even if it comes while we connect
        me = asyncio.current_task()
        if me is not None:  # cancelled by close() while it connects upstream
            self._tasks.add(me)
            me.add_done_callback(self._tasks.discard)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.append(up_writer)
        if self._closed:
            writer.close()
            up_writer.close()
            return
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._open.wait()
                data = await src.read(65536)
                if not data:
                    break
                await self._open.wait()
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()
