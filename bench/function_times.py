"""Each named function's own CPU per request inside a live prefixgate (or the bare relay).

py-spy's shares mislead on a saturated machine (a sample taken while the process waits for a
core counts as busy), and a warm loop hides what a request costs among everything else the
proxy touches. This wraps the functions named with ``--time`` (``module:qualname``, a method
as ``module:Class.method``; a name imported into another module is wrapped where it is called
from) so that each call adds up its thread CPU time (``time.thread_time``; for a coroutine,
around each of its own steps, so the awaits it waits on are not counted) and the minor page
faults it took, then offers the overhead benchmark's load to it, beside an unwrapped
prefixgate (``profile_proxy.py --against``), and prints µs and faults per request.

Run: ``python bench/function_times.py --time proxy.handlers:inference,proxy.prefixes:\
PrefixTracker.lookup [--concurrency 64] [--seconds 8] [--prompt-bytes 8192] [--relay]``.
``--relay`` times aiohttp functions inside ``bench/bare_relay.py`` instead (``--time
aiohttp.client:ClientSession._request,...``). Requests are counted as the calls of
``proxy.handlers:inference`` (the relay: aiohttp's ``RequestHandler._handle_request``), timed
too. The wrapping costs about 0.5 µs a call.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROXY_REQUEST = "proxy.handlers:inference"
RELAY_REQUEST = "aiohttp.web_protocol:RequestHandler._handle_request"
Totals = dict[str, list[float]]  # name -> [calls, seconds, faults]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@types.coroutine
def _drive(coro: Any, rec: list[float]) -> Generator[Any, Any, Any]:
    """Run ``coro`` to its end, adding the CPU of each of its own steps to ``rec``."""
    value: Any = None
    exc: BaseException | None = None
    while True:
        t0, f0 = time.thread_time(), _faults()
        try:
            step = coro.throw(exc) if exc is not None else coro.send(value)
        except StopIteration as stop:
            rec[1] += time.thread_time() - t0
            rec[2] += _faults() - f0
            return stop.value
        rec[1] += time.thread_time() - t0
        rec[2] += _faults() - f0
        exc = None
        try:
            value = yield step
        except BaseException as thrown:  # handed on to the coroutine, as an await would
            exc, value = thrown, None


def wrap(spec: str, totals: Totals) -> None:
    """Replace ``module:qualname`` with a timed version of itself."""
    module_name, _, qualname = spec.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    fn: Callable[..., Any] = getattr(owner, name)
    rec = totals.setdefault(spec, [0.0, 0.0, 0.0])
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            rec[0] += 1
            return await _drive(fn(*args, **kwargs), rec)

        setattr(owner, name, timed_async)
        return

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0, f0 = time.thread_time(), _faults()
        try:
            return fn(*args, **kwargs)
        finally:
            rec[0] += 1
            rec[1] += time.thread_time() - t0
            rec[2] += _faults() - f0

    setattr(owner, name, timed)


def serve(argv: list[str]) -> int:
    """The wrapped process: ``prefixgate serve`` (or the relay) with the functions timed."""
    totals: Totals = {}
    for spec in os.environ["FT_TIME"].split(","):
        if spec:
            wrap(spec, totals)
    try:
        if os.environ.get("FT_RELAY"):
            return relay(argv)
        from proxy.cli import main

        return main(argv)
    finally:
        Path(os.environ["FT_OUT"]).write_text(json.dumps(totals))


def relay(argv: list[str]) -> int:
    """``bare_relay.py`` started with prefixgate's ``serve`` arguments (and a /readyz)."""
    import asyncio
    import signal

    from aiohttp import web

    sys.path.insert(0, str(HERE))
    import bare_relay

    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("--backend")
    parser.add_argument("--port", type=int)
    parser.add_argument("--admin-port", type=int)
    args, _ = parser.parse_known_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    async def run() -> None:
        admin = web.Application()

        async def ready(_: web.Request) -> web.Response:
            return web.json_response({"status": "ready"})

        admin.router.add_get("/readyz", ready)
        apps = ((bare_relay.build(args.backend.rstrip("/")), args.port), (admin, args.admin_port))
        for app, port in apps:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port, backlog=2048).start()
        await asyncio.Event().wait()

    asyncio.run(run())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", required=True, help="module:qualname,... to time")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--prompt-bytes", type=int, default=8192)
    parser.add_argument("--relay", action="store_true", help="time inside the bare relay")
    args = parser.parse_args(argv)
    per_spec = RELAY_REQUEST if args.relay else PROXY_REQUEST
    specs = [s for s in args.time.split(",") if s]
    if per_spec not in specs:
        specs.append(per_spec)  # its calls are the requests
    with tempfile.TemporaryDirectory(prefix="pg-ft-") as tmp:
        out = Path(tmp) / "times.json"
        wrapper = Path(tmp) / "timed-prefixgate"
        env = f"FT_TIME={','.join(specs)} FT_OUT={out}" + (" FT_RELAY=1" if args.relay else "")
        wrapper.write_text(
            f'#!/bin/sh\n{env} exec {sys.executable} {Path(__file__).resolve()} --serve "$@"\n'
        )
        wrapper.chmod(0o755)
        run = [sys.executable, str(HERE / "profile_proxy.py"), "--this", str(wrapper)]
        run += ["--against", str(Path(sys.executable).parent / "prefixgate")]
        run += ["--concurrency", str(args.concurrency), "--seconds", str(args.seconds)]
        run += ["--prompt-bytes", str(args.prompt_bytes)]
        done = subprocess.run(run, capture_output=True, text=True)
        if done.returncode:  # (a name that does not resolve fails in the proxy's start)
            sys.exit(f"the timed run failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        print(done.stdout.strip())
        totals: Totals = json.loads(out.read_text())
    per = max(totals.get(per_spec, [1.0])[0], 1.0)
    print(f"per request ({int(per)} requests, the calls of {per_spec}):")
    for spec, (calls, seconds, faults) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(
            f"{1e6 * seconds / per:9.1f} µs {faults / per:7.1f} faults "
            f"{calls / per:6.2f} calls  {spec}"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2:]))
    sys.exit(main())
