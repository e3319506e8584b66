"""A redis-server child process for tests: started on a free port, killed, frozen, restarted."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable

import pytest
import redis

from proxy.store import PrefixStore, StoreTimeouts
from tests.ports import free_port

StoreFactory = Callable[..., Awaitable[PrefixStore]]

# Behavioural tests pin what the store answers, not how fast: generous deadlines keep a loaded
# CI machine from turning a slow lookup into a degraded (empty) answer. The failure tests set
# their own tight ones.
RELAXED = StoreTimeouts(lookup_s=1.0, write_s=1.0, read_s=5.0)
REDIS_SERVER = os.environ.get("PREFIXGATE_TEST_REDIS_SERVER", "/usr/bin/redis-server")


class RedisServer:
    """A redis-server child process that tests can kill, freeze and restart on its port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 5.0) -> None:
        """Start the server and wait until it answers PING."""
        binary = shutil.which(REDIS_SERVER) or shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                f"redis-server not found at {REDIS_SERVER} or on PATH: install it "
                "(apt-get install redis-server) or set PREFIXGATE_TEST_REDIS_SERVER; "
                "the Redis store tests never skip."
            )
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--loglevel", "warning"]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        pytest.fail(f"redis-server on port {self.port} did not start")
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server and reap it."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)
        self._proc = None

    def freeze(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def flush(self) -> None:
        client = redis.Redis(port=self.port)
        try:
            client.flushall()
        finally:
            client.close()
