"""Shutting down on a signal (proxy/server.py's ``run_app``, what ``prefixgate serve`` runs).

SIGTERM or SIGINT: the port stops listening, a request in flight is finished, the app's
shutdown and cleanup hooks run, and the process exits 0. A second signal cuts a slow shutdown
short and the cleanup hooks still run. Each case runs a tiny app in its own process, so the
signal is real.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.ports import free_port
from tests.reliability.processes import ChildProcess, http_get

APP = """
import asyncio, sys
from aiohttp import web
from proxy.server import run_app

async def slow(request):
    await asyncio.sleep(float(request.query["s"]))
    return web.Response(text="finished")

async def ok(request):
    return web.Response(text="ok")

def hook(name):
    async def mark(app):
        print(name, flush=True)
    return mark

app = web.Application()
app.router.add_get("/slow", slow)
app.router.add_get("/ok", ok)
app.on_shutdown.append(hook("on_shutdown"))
app.on_cleanup.append(hook("on_cleanup"))
run_app(app, host="127.0.0.1", port=int(sys.argv[1]))
print("returned", flush=True)
"""


def start(port: int) -> ChildProcess:
    proc = ChildProcess([sys.executable, "-c", APP, str(port)], name=f"app-{port}")
    proc.spawn()
    proc.wait_http(f"http://127.0.0.1:{port}/ok")
    return proc


def in_flight(url: str) -> tuple[threading.Thread, list[tuple[int, bytes]]]:
    """GET ``url`` on a thread; its (status, body) lands in the list."""
    got: list[tuple[int, bytes]] = []
    thread = threading.Thread(target=lambda: got.append(http_get(url, timeout_s=10)))
    thread.start()
    time.sleep(0.3)  # the request has arrived
    return thread, got


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_finishes_requests_and_cleans_up(sig: signal.Signals) -> None:
    port = free_port()
    proc = start(port)
    try:
        thread, got = in_flight(f"http://127.0.0.1:{port}/slow?s=1")
        assert proc.proc is not None
        proc.proc.send_signal(sig)
        assert proc.proc.wait(10) == 0, proc.output_tail()
        thread.join(10)
        assert got == [(200, b"finished")]
        out = proc.output_tail().split()
        assert out[-3:] == ["on_shutdown", "on_cleanup", "returned"], out
    finally:
        proc.stop()
        proc.remove_files()


def test_second_signal_cuts_shutdown_short() -> None:
    port = free_port()
    proc = start(port)
    try:
        thread, _ = in_flight(f"http://127.0.0.1:{port}/slow?s=30")
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # shutting down, waiting for /slow
        assert proc.proc.poll() is None
        proc.proc.send_signal(signal.SIGTERM)
        try:
            assert proc.proc.wait(5) == 0, proc.output_tail()
        except subprocess.TimeoutExpired:
            pytest.fail("a second SIGTERM did not stop the shutdown")
        out = proc.output_tail().split()
        assert out[-3:] == ["on_shutdown", "on_cleanup", "returned"], out
        thread.join(10)
    finally:
        proc.stop()
        proc.remove_files()


def test_prefixgate_serve_exits_on_sigterm() -> None:
    """The real command: SIGTERM, exit 0 (its resources closed by the cleanup hook)."""
    port, admin_port = free_port(), free_port()
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port)]
    argv += ["--admin-port", str(admin_port)]
    argv += ["--backend", f"http://127.0.0.1:{free_port()}", "--connect-timeout", "0.2"]
    proc = ChildProcess(argv, name=f"proxy-{port}")
    proc.spawn()
    try:
        proc.wait_http(f"http://127.0.0.1:{admin_port}/healthz")
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(10) == 0, proc.output_tail()
        assert "Traceback" not in proc.output_tail(), proc.output_tail()
    finally:
        proc.stop()
        proc.remove_files()
