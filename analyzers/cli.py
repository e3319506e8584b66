"""``prefixgate analyze PATH…``: the analyzer's command line (a PATH may be a directory).

``add_analyze_parser`` registers the sub-command on the ``prefixgate`` parser and
``run_analyze`` runs it; ``main`` serves ``python -m analyzers``. The terminal report goes to
stdout (or the ``--json`` document does), progress for large inputs to stderr; an input that
cannot be read prints one line and exits non-zero.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from analyzers.analysis import Analysis, AnalyzeOptions, analyze
from analyzers.capacity import DEFAULT_POINTS
from analyzers.html import write_html
from analyzers.inputs import input_files
from analyzers.providers import DEFAULT_MIN_CACHEABLE_TOKENS
from analyzers.report import print_report

PROGRESS_MIN_BYTES = 8 << 20  # show a progress bar from this much input on


def add_analyze_parser(subparsers: Any) -> None:
    """Register ``analyze`` on a ``parser.add_subparsers()`` object."""
    parser = subparsers.add_parser(
        "analyze",
        help="explain where prompt caching was lost in logs or traces",
        description=(
            "Read prefixgate JSON logs, OpenAI request-body JSONL, Mooncake or kv-cache-tester "
            "traces; report ideal vs measured hit rate, the capacity curve, shared prefixes, "
            "cache breakers, provider rules and goodput."
        ),
    )
    configure_parser(parser)
    parser.set_defaults(func=run_analyze)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """The analyze arguments, shared by the sub-command and ``python -m analyzers``."""
    parser.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="input files (gzip or xz too), or directories of them",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON document instead")
    parser.add_argument("--html", type=Path, metavar="FILE", help="also write an HTML report")
    parser.add_argument(
        "--min-cacheable-tokens",
        type=int,
        default=DEFAULT_MIN_CACHEABLE_TOKENS,
        help="provider minimum cacheable prefix (default: %(default)s, as OpenAI)",
    )
    parser.add_argument(
        "--max-backends-per-prompt",
        type=int,
        default=1,
        help="backends one application prompt may use before it counts as spread",
    )
    parser.add_argument(
        "--capacity",
        type=int,
        action="append",
        metavar="TOKENS",
        help="simulate this cache size (repeatable; default: log-spaced sizes)",
    )
    parser.add_argument(
        "--capacity-points", type=int, default=DEFAULT_POINTS, help="sizes on the default curve"
    )
    parser.add_argument("--top", type=int, default=10, help="rows per table (default: 10)")
    parser.add_argument("--no-progress", action="store_true", help="never show a progress bar")


def _run(args: argparse.Namespace, paths: list[Path], err: Console) -> Analysis:
    options = AnalyzeOptions(
        min_cacheable_tokens=args.min_cacheable_tokens,
        max_backends_per_prompt=args.max_backends_per_prompt,
        capacities=tuple(args.capacity) if args.capacity else None,
        capacity_points=args.capacity_points,
        top=args.top,
    )
    total = sum(p.stat().st_size for p in paths)
    if args.no_progress or total < PROGRESS_MIN_BYTES or not err.is_terminal:
        return analyze(paths, options)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
    )
    after = {"read": "unbounded replay", "ideal": "capacity curve", "capacity": "prefix tree"}
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("reading", total=total)
        return analyze(
            paths,
            options,
            progress=lambda n: bar.advance(task, n),
            phase=lambda done: bar.update(task, description=after.get(done, "findings")),
        )


def run_analyze(args: argparse.Namespace) -> int:
    """Run ``analyze`` for parsed arguments; the process exit status."""
    err = Console(stderr=True)
    missing = [p for p in args.paths if not p.exists()]
    if missing:
        err.print(f"prefixgate analyze: no such file: {missing[0]}", markup=False)
        return 2
    paths = input_files(args.paths)
    if not paths:
        err.print(f"prefixgate analyze: no input files in {args.paths[0]}", markup=False)
        return 2
    try:
        result = _run(args, paths, err)
    except (OSError, ValueError) as exc:
        err.print(f"prefixgate analyze: {exc}", markup=False)
        return 1
    if args.html:
        write_html(result, args.html, top=args.top)
    if args.json:
        doc = result.to_json(top=args.top)
        sys.stdout.buffer.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
        sys.stdout.flush()
    else:
        print_report(result, Console(), top=args.top)
        sys.stdout.flush()
        if args.html:
            err.print(f"HTML report written to {args.html}", markup=False)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m analyzers PATH…``."""
    parser = argparse.ArgumentParser(prog="python -m analyzers", description=__doc__)
    configure_parser(parser)
    return run_analyze(parser.parse_args(argv))
