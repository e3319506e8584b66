"""A local Redis Cluster for tests: N redis-server children in cluster mode, no replicas.

Every node owns an equal range of the 16,384 slots (``CLUSTER ADDSLOTSRANGE``), the nodes meet
each other (``CLUSTER MEET``), and ``start`` returns once every node reports ``cluster_state:ok``
and agrees on who owns every slot. A node can be killed and restarted on its port: it keeps its
identity and slots through its ``nodes.conf`` (its data is gone: nothing is persisted).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from tests.ports import free_port
from tests.store.redis_process import REDIS_SERVER

SLOTS = 16384


class RedisClusterServer:
    """``size`` cluster-mode redis-servers on free ports, the slots split evenly among them."""

    def __init__(self, size: int = 3, node_timeout_ms: int = 1000) -> None:
        self.ports = [free_port() for _ in range(size)]
        # The bus port is given explicitly: the default (port + 10000) fails above 55535.
        self.bus_ports = {port: free_port() for port in self.ports}
        self.node_timeout_ms = node_timeout_ms
        self._dir = Path(tempfile.mkdtemp(prefix="pg-cluster-"))
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """The proxy's URL: one seed node, the client discovers the rest."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self, timeout_s: float = 15.0) -> None:
        """Start every node, assign the slots, join them and wait for ``cluster_state:ok``."""
        for port in self.ports:
            self.start_node(port)
        per = SLOTS // len(self.ports)
        for i, port in enumerate(self.ports):
            last = SLOTS - 1 if i == len(self.ports) - 1 else (i + 1) * per - 1
            with self._client(port) as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
        with self._client(self.ports[0]) as c:
            for port in self.ports[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", port, self.bus_ports[port])
        self.wait_ok(timeout_s)

    def start_node(self, port: int, timeout_s: float = 5.0) -> None:
        """Start (or restart) the node on ``port`` and wait until it answers PING."""
        binary = shutil.which(REDIS_SERVER) or shutil.which("redis-server")
        if binary is None:
            pytest.fail(f"redis-server not found at {REDIS_SERVER} or on PATH (tests never skip)")
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self._dir)]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
        args += ["--cluster-port", str(self.bus_ports[port])]
        args += ["--cluster-node-timeout", str(self.node_timeout_ms)]
        args += ["--save", "", "--appendonly", "no", "--loglevel", "warning"]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._procs[port] = proc
        deadline = time.monotonic() + timeout_s
        with self._client(port) as c:
            while True:
                try:
                    if c.ping():
                        return
                except redis.RedisError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        pytest.fail(f"cluster node on port {port} did not start")
                    time.sleep(0.02)

    def wait_ok(self, timeout_s: float = 15.0) -> None:
        """Wait until every node says ``cluster_state:ok`` and they agree on the slot owners."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._agreed():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"cluster on ports {self.ports} did not reach cluster_state:ok")
            time.sleep(0.05)

    def _agreed(self) -> bool:
        views = []
        for port in self.ports:
            with self._client(port) as c:
                info = c.execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                if (
                    "cluster_state:ok" not in text
                    or f"cluster_known_nodes:{len(self.ports)}" not in text
                ):
                    return False
                slots = c.execute_command("CLUSTER", "SLOTS")
                views.append(sorted((s[0], s[1], int(s[2][1])) for s in slots))
        return all(v == views[0] for v in views) and len(views[0]) == len(self.ports)

    def port_of_slot(self, slot: int) -> int:
        """The port of the node that owns ``slot``."""
        port = self._owner_seen_by(next(iter(self._procs)), slot)
        assert port is not None, f"slot {slot} is not covered"
        return port

    def kill(self, port: int) -> None:
        """SIGKILL one node and reap it."""
        proc = self._procs.pop(port, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def freeze(self, port: int) -> None:
        """SIGSTOP one node: its port still accepts connections but nothing answers."""
        self._procs[port].send_signal(signal.SIGSTOP)

    def thaw(self, port: int) -> None:
        self._procs[port].send_signal(signal.SIGCONT)

    def node_id(self, port: int) -> str:
        with self._client(port) as c:
            raw = c.execute_command("CLUSTER", "MYID")
            return raw.decode() if isinstance(raw, bytes) else str(raw)

    def move_slot(self, slot: int, to_port: int) -> None:
        """Hand an (empty) slot to the node on ``to_port``, as a resharding would."""
        target = self.node_id(to_port)
        for port in self.ports:
            with self._client(port) as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target)
        deadline = time.monotonic() + 10
        while any(self._owner_seen_by(port, slot) != to_port for port in self.ports):
            if time.monotonic() > deadline:
                pytest.fail(f"slot {slot} did not move to {to_port}")
            time.sleep(0.05)

    def _owner_seen_by(self, port: int, slot: int) -> int | None:
        with self._client(port) as c:
            for first, last, owner, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if first <= slot <= last:
                    return int(owner[1])
        return None

    def flush(self) -> None:
        """Empty every node (keys only; scripts stay cached)."""
        for port in self.ports:
            with self._client(port) as c:
                c.flushall()

    def stop(self) -> None:
        """Kill every node and remove the config files."""
        for port in list(self._procs):
            self.kill(port)
        shutil.rmtree(self._dir, ignore_errors=True)

    @staticmethod
    def _client(port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=2.0)
