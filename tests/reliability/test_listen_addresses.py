"""``prefixgate serve`` listens on every address it is given (``--host A,B``, repeated, TOML)."""

from __future__ import annotations

import sys
from pathlib import Path

from proxy.config import resolve
from tests.reliability.processes import ChildProcess, free_port, http_get


def test_host_takes_several_addresses(tmp_path: Path) -> None:
    """Comma-separated, repeated, bracketed or a TOML list: each address once, in order."""
    env: dict[str, str] = {}
    flags = {"backend": ["http://127.0.0.1:9"], "host": ["127.0.0.1,[::1]", "::1", "0.0.0.0"]}
    assert resolve(flags, environ=env).hosts == ("127.0.0.1", "::1", "0.0.0.0")
    from_env = resolve({"backend": ["http://127.0.0.1:9"]}, environ={"PREFIXGATE_HOST": "::1,a"})
    assert from_env.hosts == ("::1", "a") and from_env.host == "::1"
    toml = tmp_path / "p.toml"
    toml.write_text('host = ["127.0.0.1", "::1"]\nadmin_host = "127.0.0.1"\nadmin_port = 9001\n')
    settings = resolve({"backend": ["http://127.0.0.1:9"], "config": str(toml)}, environ={})
    assert settings.hosts == ("127.0.0.1", "::1")
    assert settings.admin_listen == ("127.0.0.1",) and settings.admin_port == 9001
    default = resolve({"backend": ["http://127.0.0.1:9"]}, environ={})
    assert default.hosts == ("127.0.0.1",) and default.admin_listen == default.hosts
    assert (default.port, default.admin_port) == (8000, 8001)


def test_serve_listens_on_ipv4_and_ipv6_loopback() -> None:
    """``--host 127.0.0.1,::1``: both the traffic and the admin listener answer on both."""
    port, admin_port = free_port(), free_port()
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--host", "127.0.0.1,::1"]
    argv += ["--port", str(port), "--admin-port", str(admin_port)]
    argv += ["--backend", f"http://127.0.0.1:{free_port()}", "--connect-timeout", "0.2"]
    proc = ChildProcess(argv, name=f"proxy-{port}")
    proc.spawn()
    try:
        proc.wait_http(f"http://127.0.0.1:{admin_port}/healthz")
        for host in ("127.0.0.1", "[::1]"):
            assert http_get(f"http://{host}:{admin_port}/healthz")[0] == 200, host
            # The traffic port forwards to the (unreachable) backend: the proxy's own 502.
            status, body = http_get(f"http://{host}:{port}/v1/models")
            assert status == 502 and b"backend" in body, host
        assert http_get(f"http://[::1]:{port}/healthz")[0] == 502  # the backend's path, not ours
    finally:
        proc.stop()
        proc.remove_files()
