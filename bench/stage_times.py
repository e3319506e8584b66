"""Where a request's time goes inside prefixgate, stage by stage, under the overhead load.

Starts the fake streaming backend (and, with ``--redis``, a redis-server), then prefixgate
through this same file (``--serve``), which wraps the record writer to keep each request's
timestamps, and offers closed-loop load (``--concurrency``, ``--requests``, ``--prompt-bytes``,
the overhead benchmark's bodies). Prints the median wall time of each stage, in µs, over the
requests after the first 50:

    read        the body read off the socket
    parse+canon parsing, validation, the canonicalizer
    lookup      the fingerprint and the store's lookup
    route       the router's choice
    admit       the slot scheduler (and any wait it decides)
    to_forward  the proxy's fields spliced in, up to the upstream call
    headers     the upstream call until the backend's status line
    first_event from the status line to the first token event read
    inspect     stream inspection over the whole answer (summed)
    record      building, writing and handing out the record
    pre_forward body read to upstream call (what ``proxy_overhead_ms`` counts, with inspect)

Run: ``python bench/stage_times.py [--concurrency 1] [--requests 400] [--prompt-bytes 8192]
[--tokens 16] [--itl-ms 2] [--redis] [--extra "FLAGS"]``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

STAGES = (
    "read",
    "parse+canon",
    "lookup",
    "route",
    "admit",
    "to_forward",
    "headers",
    "first_event",
)


def serve(argv: list[str], out: Path) -> None:
    """``prefixgate serve`` with the record writer wrapped (the ``--serve`` half)."""
    from proxy import record_writer, records
    from proxy.cli import main

    rows: list[tuple[float, ...]] = []
    emit = record_writer.RecordWriter.emit

    def timed(  # type: ignore[no-untyped-def]
        self: record_writer.RecordWriter, record: records.RequestRecord, stages: object = None
    ):
        t0 = records.monotonic()
        emit(self, record, stages)
        obs = getattr(stages, "obs", None)
        if obs is None or obs.t_forward is None or obs.t_first_token is None:
            return
        marks = (
            obs.t_start,
            obs.t_body_read,
            obs.t_canonical,
            obs.t_lookup,
            obs.t_routed,
            obs.t_admitted,
            obs.t_forward,
            obs.t_headers,
            obs.t_first_token,
        )
        if any(m is None for m in marks):
            return
        rows.append((*marks, obs.inspect_s, records.monotonic() - t0))  # type: ignore[arg-type]

    record_writer.RecordWriter.emit = timed  # type: ignore[method-assign]

    def dump() -> None:
        kept = rows[50:] or rows
        if not kept:
            return
        lines = []
        for i, name in enumerate(STAGES):
            lines.append(f"{name} {1e6 * statistics.median(r[i + 1] - r[i] for r in kept):.1f}")
        lines.append(f"inspect {1e6 * statistics.median(r[9] for r in kept):.1f}")
        lines.append(f"record {1e6 * statistics.median(r[10] for r in kept):.1f}")
        lines.append(f"pre_forward {1e6 * statistics.median(r[6] - r[1] for r in kept):.1f}")
        lines.append(f"requests {len(kept)}")
        out.write_text("\n".join(lines) + "\n")

    atexit.register(dump)
    sys.argv = ["prefixgate", *argv]
    main()


def measure(args: argparse.Namespace) -> int:
    import loadgen
    import procs
    from bench_overhead import salted_bodies

    bodies = salted_bodies(args.prompt_bytes, args.tokens)
    with tempfile.TemporaryDirectory(prefix="pg-stages-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        out = workdir / "stages.txt"
        wrapper = workdir / "prefixgate-stages"
        wrapper.write_text(
            f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} --serve {out} "$@"\n'
        )
        wrapper.chmod(0o755)
        fake = stack.enter_context(
            procs.start_fake(workdir, tokens=args.tokens, itl_ms=args.itl_ms, slots=args.fake_slots)
        )
        redis_url = stack.enter_context(procs.start_redis(workdir)).url if args.redis else None
        proxy = stack.enter_context(
            procs.start_prefixgate(
                workdir,
                fake.url,
                redis_url=redis_url,
                extra=args.extra.split(),
                command=[str(wrapper)],
            )
        )
        url = proxy.url + loadgen.CHAT_PATH
        results, window = asyncio.run(
            loadgen.closed_loop(
                url, bodies, concurrency=args.concurrency, requests=args.requests + 50
            )
        )
        summary = loadgen.summarize(results, window, loadgen.Slo())
        stack.close()  # the proxy writes its table as it exits
        print(
            f"{args.concurrency} stream(s), {args.prompt_bytes} B prompts"
            f"{', Redis' if args.redis else ''}: {summary['rps']} req/s, client TTFT p50 "
            f"{summary['ttft_ms']['p50']} ms"
        )
        print("stage medians, µs:")
        print(out.read_text() if out.exists() else "(no table: the proxy did not write one)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        serve(argv[2:], Path(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--prompt-bytes", type=int, default=8192)
    parser.add_argument("--redis", action="store_true")
    parser.add_argument("--fake-slots", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16, help="the fake's answer length")
    parser.add_argument("--itl-ms", type=float, default=2.0, help="the fake's gap between tokens")
    parser.add_argument("--extra", default="", help="more `prefixgate serve` flags")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return measure(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
