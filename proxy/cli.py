"""The ``prefixgate`` command: ``serve`` the proxy, ``analyze`` logs and traces, ``simulate``.

Thin by design: parse, resolve settings, run; a bad setting prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from proxy.config import ConfigError, add_serve_arguments, resolve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixgate",
        description="Prompt-caching proxy for llama.cpp and vLLM backends.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the proxy in front of one or more backends",
        description=(
            "Serve the OpenAI API in front of llama-server / vLLM backends. Every option can "
            "also be set as PREFIXGATE_<NAME> in the environment or in the TOML file given by "
            "--config; flags win over the environment, which wins over the file."
        ),
    )
    add_serve_arguments(serve)
    # The analyzer is an offline tool; proxy/ only hands it the command line.
    from analyzers.cli import add_analyze_parser
    from analyzers.quality import add_quality_parser
    from analyzers.simulate import add_simulate_parser

    add_analyze_parser(sub)
    add_quality_parser(sub)
    add_simulate_parser(sub)
    return parser


def serve(args: argparse.Namespace) -> int:
    from proxy.app import admin_app, build_app
    from proxy.log import configure_logging, get_logger
    from proxy.server import run_app

    try:
        settings = resolve(args)
    except ConfigError as exc:
        print(f"prefixgate: {exc}", file=sys.stderr)
        return 2
    configure_logging(level=settings.log_level, log_file=settings.log_file)
    try:
        app = build_app(settings)
    except ConfigError as exc:
        print(f"prefixgate: {exc}", file=sys.stderr)
        return 2
    get_logger().info(
        "starting",
        host=list(settings.hosts),
        port=settings.port,
        admin_host=list(settings.admin_listen),
        admin_port=settings.admin_port,
    )
    # aiohttp with its own error answers in the OpenAI shape, handler cancellation, backlog 2048,
    # no access log; SIGTERM shuts down gracefully (proxy/server.py). The admin routes listen
    # apart, on --admin-port.
    run_app(
        app,
        host=settings.hosts,
        port=settings.port,
        admin=admin_app(app),
        admin_host=settings.admin_listen,
        admin_port=settings.admin_port,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "quality":
        from analyzers.quality import run_quality

        return run_quality(args)
    if args.command == "simulate":
        from analyzers.simulate import run_simulate

        return run_simulate(args)
    from analyzers.cli import run_analyze

    return run_analyze(args)


if __name__ == "__main__":
    sys.exit(main())
