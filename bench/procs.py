"""Child processes for the benchmarks: the fake backend, nginx, LiteLLM, Redis, prefixgate,
llama-server; started on free ports, waited on until they answer, stopped, and measured (RSS).

Everything runs as a child of the harness with its files in a temporary directory, so a run
needs no root, leaves nothing behind and never touches a system-wide service. Each ``start_*``
returns a ``Proc`` (a context manager) whose ``url`` is the base URL to send requests to.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # deploy/ and tests/ helpers, when a bench script runs

from deploy import local_llama  # noqa: E402
from tests.ports import free_port  # noqa: E402

BENCH = ROOT / "bench"
LITELLM_VENV = BENCH / ".venv-litellm"
PR_SET_PDEATHSIG = 1


class BenchError(RuntimeError):
    """A component is missing or did not start."""


STARTED: list[Proc] = []
"""Every child process started here (their CPU time is the benchmark's own)."""


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            status: int = resp.status
            return 200 <= status < 300
    except (OSError, urllib.error.URLError):
        return False


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def rss_kb(pids: Sequence[int]) -> int:
    """Resident set size of the processes, summed, in KiB."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total


def machine_busy_ticks() -> int:
    """CPU time spent busy on the whole machine, all cores, in clock ticks (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal


def process_ticks(pids: Sequence[int]) -> int:
    """User + system CPU time of the processes, in clock ticks."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


class OtherLoad:
    """How much CPU everything *but* this benchmark used while the block ran, in cores.

    The benchmark is this process and every child it started (``STARTED``); the rest is other
    work sharing the machine, which the results should be read against.
    """

    def __init__(self) -> None:
        self.cores: float | None = None

    def _own(self) -> int:
        pids = [os.getpid()]
        for proc in STARTED:
            if proc.alive():
                pids += proc.pids()
        return process_ticks(pids)

    def __enter__(self) -> OtherLoad:
        self._t0 = time.monotonic()
        self._busy0 = machine_busy_ticks()
        self._own0 = self._own()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self._t0
        other = (machine_busy_ticks() - self._busy0) - (self._own() - self._own0)
        hz = os.sysconf("SC_CLK_TCK")
        self.cores = round(max(other, 0) / hz / wall, 2) if wall > 0 else None


@dataclass
class Proc:
    """A started child process (and its name, URL and log) that stops on ``close``."""

    name: str
    popen: subprocess.Popen[bytes]
    url: str
    log_path: Path
    extra_files: dict[str, Path] = field(default_factory=dict)
    admin_url: str = ""
    """prefixgate: its admin listener (``/stats``, ``/metrics``)."""
    _pids: list[int] = field(default_factory=list)

    def pids(self, refresh: bool = False) -> list[int]:
        """The process tree (nginx and uvicorn have workers), found once, then remembered."""
        if refresh or not self._pids:
            self._pids = tree_pids(self.popen.pid)
        return self._pids

    def rss_kb(self) -> int:
        return rss_kb(self.pids())

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def __enter__(self) -> Proc:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RssSampler:
    """Samples a process tree's RSS in a thread and keeps the peak."""

    def __init__(self, proc: Proc | None, every_s: float = 0.1) -> None:
        self.proc = proc
        self.every_s = every_s
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RssSampler:
        if self.proc is not None:
            self.peak_kb = self.proc.rss_kb()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        assert self.proc is not None
        while not self._stop.wait(self.every_s):
            self.peak_kb = max(self.peak_kb, self.proc.rss_kb())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.proc is not None:
            self.peak_kb = max(self.peak_kb, self.proc.rss_kb())

    @property
    def peak_mb(self) -> float | None:
        return round(self.peak_kb / 1024.0, 1) if self.proc is not None else None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the benchmark dies, so a crash leaves no orphan."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(
    name: str,
    args: Sequence[str],
    *,
    workdir: Path,
    ready_url: str,
    url: str,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> Proc:
    log_path = workdir / f"{name}-{url.rsplit(':', 1)[-1]}.log"
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it; closed when we return
    try:
        popen = subprocess.Popen(
            list(args),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(ROOT),
            env={**os.environ, **(env or {})},
            preexec_fn=_die_with_parent,
        )
    finally:
        log.close()
    proc = Proc(name=name, popen=popen, url=url, log_path=log_path)
    STARTED.append(proc)
    deadline = time.monotonic() + timeout_s
    while not http_ok(ready_url):
        if popen.poll() is not None:
            raise BenchError(f"{name} exited with {popen.returncode}:\n{proc.log_tail()}")
        if time.monotonic() > deadline:
            proc.close()
            raise BenchError(f"{name} did not answer {ready_url} in {timeout_s:.0f} s")
        time.sleep(0.1)
    return proc


def start_fake(
    workdir: Path,
    *,
    tokens: int = 16,
    itl_ms: float = 2.0,
    ttft_ms: float = 0.0,
    slots: int = 8,
) -> Proc:
    """The fast fake backend (``bench/fake_backend.py``)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, str(BENCH / "fake_backend.py"), "--port", str(port)]
    args += ["--tokens", str(tokens), "--itl-ms", str(itl_ms), "--ttft-ms", str(ttft_ms)]
    args += ["--slots", str(slots)]
    return _spawn("fake", args, workdir=workdir, ready_url=url + "/health", url=url)


NGINX_CONF = """\
{user}worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy_temp;
    fastcgi_temp_path {dir}/fastcgi_temp;
    uwsgi_temp_path {dir}/uwsgi_temp;
    scgi_temp_path {dir}/scgi_temp;
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    upstream backend {{
        server {upstream};
        keepalive 512;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def nginx_binary() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if found is None:
        raise BenchError("nginx not found: apt-get install nginx (make bench does it)")
    return found


def start_nginx(workdir: Path, upstream_url: str) -> Proc:
    """nginx as a plain streaming reverse proxy: one worker, keep-alive upstream, no buffering.

    Runs in the foreground from a generated config in ``workdir``; as root it keeps root as the
    worker user so the workers can use ``workdir``.
    """
    port = free_port()
    conf_dir = workdir / "nginx"
    conf_dir.mkdir(exist_ok=True)
    user = "user root;\n" if os.geteuid() == 0 else ""
    upstream = upstream_url.removeprefix("http://").rstrip("/")
    conf = conf_dir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(user=user, dir=conf_dir, upstream=upstream, port=port))
    args = [nginx_binary(), "-p", str(conf_dir), "-c", str(conf), "-e", str(conf_dir / "e.log")]
    args += ["-g", "daemon off;"]
    url = f"http://127.0.0.1:{port}"
    return _spawn("nginx", args, workdir=workdir, ready_url=url + "/health", url=url)


def start_bare_relay(workdir: Path, upstream_url: str) -> Proc:
    """``bench/bare_relay.py``: the floor of an aiohttp proxy (forwards, streams, nothing else)."""
    port = free_port()
    args = [sys.executable, str(BENCH / "bare_relay.py"), "--upstream", upstream_url]
    args += ["--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    return _spawn("aiohttp-relay", args, workdir=workdir, ready_url=url + "/health", url=url)


LITELLM_CONF = """\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {api_base}/v1
      api_key: unused
litellm_settings:
  telemetry: false
  drop_params: true
"""


def litellm_binary() -> Path:
    path = LITELLM_VENV / "bin" / "litellm"
    if not path.exists():
        raise BenchError(
            f"LiteLLM not installed at {path}: run `make bench-litellm` "
            "(python3 -m venv bench/.venv-litellm && pip install 'litellm[proxy]')"
        )
    return path


def start_litellm(workdir: Path, upstream_url: str, model: str = "bench-model") -> Proc:
    """LiteLLM's proxy, from its own venv, as a plain pass-through to an OpenAI-compatible URL."""
    port = free_port()
    conf = workdir / "litellm.yaml"
    conf.write_text(LITELLM_CONF.format(model=model, api_base=upstream_url.rstrip("/")))
    args = [str(litellm_binary()), "--config", str(conf), "--host", "127.0.0.1"]
    args += ["--port", str(port), "--num_workers", "1"]
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
        "DISABLE_SCHEMA_UPDATE": "True",
        # No auth, no database: the lightest pass-through LiteLLM offers (fairest to it).
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    }
    url = f"http://127.0.0.1:{port}"
    return _spawn(
        "litellm",
        args,
        workdir=workdir,
        ready_url=url + "/health/liveliness",
        url=url,
        timeout_s=180.0,
        env=env,
    )


def redis_binary() -> str:
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )
    if found is None:
        raise BenchError("redis-server not found: apt-get install redis-server")
    return found


def start_redis(workdir: Path) -> Proc:
    """A throw-away redis-server (no persistence) on a free port; ``url`` is its redis:// URL."""
    port = free_port()
    args = [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    args += ["--appendonly", "no", "--dir", str(workdir)]
    log_path = workdir / f"redis-{port}.log"
    log = open(log_path, "ab")  # noqa: SIM115
    try:
        popen = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
    finally:
        log.close()
    proc = Proc(name="redis", popen=popen, url=f"redis://127.0.0.1:{port}/0", log_path=log_path)
    STARTED.append(proc)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            pass
        if popen.poll() is not None or time.monotonic() > deadline:
            proc.close()
            raise BenchError(f"redis-server did not start:\n{proc.log_tail()}")
        time.sleep(0.05)


def prefixgate_command() -> list[str]:
    script = Path(sys.executable).parent / "prefixgate"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "proxy.cli"]


def start_prefixgate(
    workdir: Path,
    backend_url: str,
    *,
    redis_url: str | None = None,
    name: str = "prefixgate",
    extra: Sequence[str] = (),
    command: Sequence[str] | None = None,
) -> Proc:
    """``prefixgate serve`` in front of ``backend_url``; records in ``extra_files['records']``.

    ``command``: another installation's ``prefixgate`` (another worktree's, to compare two)."""
    port, admin_port = free_port(), free_port()
    records = workdir / f"{name}-records.jsonl"
    args = [*(command or prefixgate_command()), "serve", "--backend", backend_url]
    args += ["--port", str(port)]
    args += ["--admin-port", str(admin_port), "--log-file", str(records)]
    if redis_url:
        args += ["--redis-url", redis_url]
    args += list(extra)
    url = f"http://127.0.0.1:{port}"
    ready = f"http://127.0.0.1:{admin_port}/readyz"  # the admin listener
    proc = _spawn(name, args, workdir=workdir, ready_url=ready, url=url, timeout_s=60)
    proc.extra_files["records"] = records
    proc.admin_url = f"http://127.0.0.1:{admin_port}"
    return proc


def llama_server_binary() -> str:
    try:
        return local_llama.llama_server_binary()
    except local_llama.MissingPiece as exc:
        raise BenchError(str(exc)) from exc


def smollm2_model() -> str:
    try:
        return local_llama.smollm2_model()
    except local_llama.MissingPiece as exc:
        raise BenchError(str(exc)) from exc


def start_llama_server(
    workdir: Path, *, slots: int = 1, ctx: int = 4096, extra: Sequence[str] = ()
) -> Proc:
    """A real llama-server with SmolLM2 (as tests/integration/llama.py starts it).

    ``slots`` 0: the server's own slot setup (no ``-np``: four slots, unified KV).
    """
    port = free_port()
    args = [llama_server_binary(), "-m", smollm2_model(), "--host", "127.0.0.1"]
    args += ["--port", str(port), "-c", str(ctx), "-t", "2", "--metrics"]
    if slots > 0:
        args += ["-np", str(slots)]
    args += list(extra)
    url = f"http://127.0.0.1:{port}"
    return _spawn(
        "llama-server", args, workdir=workdir, ready_url=url + "/health", url=url, timeout_s=120
    )
