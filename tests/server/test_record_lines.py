"""The record as it reaches the log: real JSON lines match the published schema and the
analyzer reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from fakes import LlamaFake, MakeProxy
from record_check import violations

from analyzers.readers import RECORDS, detect_format, read_paths
from proxy.log import configure_logging
from proxy.records import RequestRecord
from proxy.state import STATE

SYSTEM = " ".join(f"rule{i}" for i in range(40))


def chat(question: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        **fields,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }


def request_lines(path: Path) -> list[dict[str, Any]]:
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return [obj for obj in lines if obj.get("event") == "request"]


async def test_logged_records_match_the_schema_and_the_analyzer_reads_them(
    llama_fake: LlamaFake, make_proxy: MakeProxy, tmp_path: Path
) -> None:
    """Lines of plain, streamed, failed and prompt-logging requests validate and are analyzed."""
    log = tmp_path / "records.jsonl"
    plain, plain_records, _ = await make_proxy(llama_fake.url)
    logging_prompts, records, _ = await make_proxy(llama_fake.url, log_prompts=True)
    configure_logging(log_file=str(log))
    try:
        for client, written, n, body in (
            (plain, plain_records, 1, chat("what is one plus one")),
            (plain, plain_records, 2, chat("what is two plus two", stream=True)),
            (logging_prompts, records, 1, chat("what is three plus three", prompt_cache_key="t")),
            (plain, plain_records, 3, {"model": "fake-model", "messages": "not a list"}),  # 400
        ):
            async with client.post("/v1/chat/completions", json=body) as resp:
                await resp.read()
            await written.wait(n)  # each line in turn (a record waits a moment to go out)
    finally:
        configure_logging()  # closes the file
    lines = request_lines(log)
    assert len(lines) == 4
    for line in lines:
        assert violations(line) == [], line
    assert {line["status"] for line in lines} == {200, 400}
    assert "body" in lines[2] and "prefix_segments" in lines[0]
    assert detect_format(log) == RECORDS
    trace = read_paths([log])
    assert len(trace.requests) == 3 and trace.errors == 1
    assert all(r.keys for r in trace.requests)
    assert trace.requests[2].affinity_key == int(lines[2]["affinity_key"], 16)


def test_a_record_line_is_the_line_structlog_writes(tmp_path: Path) -> None:
    """``info_line`` (a record per request, without the processor chain) writes what
    ``log.info`` writes with the same configuration: keys, order, bound context, level."""
    import structlog

    from proxy.log import get_logger, info_line

    log = tmp_path / "lines.jsonl"
    configure_logging(log_file=str(log))
    try:
        structlog.contextvars.bind_contextvars(request_id="rid-1", tenant="team-a")
        fields = {"request_id": "rid-1", "status": 200, "ttft_ms": 1.5, "rules": ["a"], "x": None}
        get_logger("prefixgate.records").info("request", **dict(fields))
        assert info_line("request", dict(fields)) is True
    finally:
        structlog.contextvars.clear_contextvars()
        configure_logging()
    via_structlog, direct = (orjson.loads(line) for line in log.read_bytes().splitlines())
    assert list(direct) == list(via_structlog)  # the same keys in the same order
    via_structlog.pop("logged_at"), direct.pop("logged_at")
    assert direct == via_structlog
    assert direct["tenant"] == "team-a" and direct["level"] == "info"


def test_a_record_line_defers_to_a_capture(tmp_path: Path) -> None:
    """With structlog configured elsewhere (a test's capture), nothing is written directly."""
    from structlog.testing import LogCapture

    from proxy.log import info_line

    configure_logging(log_file=str(tmp_path / "unused.jsonl"))
    import structlog

    structlog.configure(processors=[LogCapture()])
    try:
        assert info_line("request", {"status": 200}) is False
    finally:
        configure_logging()
    assert (tmp_path / "unused.jsonl").read_bytes() == b""
    configure_logging(level="warning")
    try:
        assert info_line("request", {"status": 200}) is False  # info lines are filtered out
    finally:
        configure_logging()


def test_a_record_line_defers_to_capture_logs(tmp_path: Path) -> None:
    """``structlog.testing.capture_logs`` edits the processors in place: still noticed."""
    import structlog

    from proxy.log import info_line

    configure_logging(log_file=str(tmp_path / "unused.jsonl"))
    try:
        with structlog.testing.capture_logs() as logs:
            assert info_line("request", {"status": 200}) is False
        assert logs == []
        assert info_line("request", {"status": 200}) is True  # the capture is over
    finally:
        configure_logging()


def test_the_lines_of_a_batch_go_out_together(tmp_path: Path) -> None:
    """Inside ``lines_held`` record lines are kept, and written in one go when it ends."""
    from proxy.log import info_line, lines_held

    log = tmp_path / "lines.jsonl"
    configure_logging(log_file=str(log))
    try:
        with lines_held():
            assert info_line("request", {"request_id": "a"}) is True
            with lines_held():  # nested: the outer one writes
                assert info_line("request", {"request_id": "b"}) is True
            assert log.read_bytes() == b""
        assert [line["request_id"] for line in request_lines(log)] == ["a", "b"]
    finally:
        configure_logging()


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def test_reading_metrics_or_stats_first_writes_the_held_records(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """``/metrics`` and ``/stats`` count every request that has ended, its record held or not
    (the records' sink here is a plain list, which does not write them when read)."""
    client, _, app = await make_proxy(llama_fake.url)
    writer = app[STATE].writer
    writer.BATCH_DELAY_S = 60.0  # held until read, however slow the machine
    seen: list[RequestRecord] = []
    writer.add_sink(seen.append)
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 200
    await resp.read()
    assert seen == [] and writer._ended  # held
    page = await (await client.admin.get("/metrics")).text()
    assert len(seen) == 1
    assert "prefixgate_requests_total{" in page
    resp = await client.post("/v1/chat/completions", json=CHAT)
    await resp.read()
    stats = await (await client.admin.get("/stats")).json()
    assert len(seen) == 2
    assert stats["totals"]["requests"] == 2


async def test_stats_counts_the_request_that_just_ended_with_writes_not_queued(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """With no write queue (``--store-write-delay-ms 0``) the statistics are written by the
    learner's own background work, which ``/stats`` waits for once it has written the held
    records."""
    client, _, app = await make_proxy(llama_fake.url, store_write_delay_ms=0.0)
    writer = app[STATE].writer
    writer.BATCH_DELAY_S = 60.0  # held until read, however slow the machine
    seen: list[RequestRecord] = []
    writer.add_sink(seen.append)
    resp = await client.post("/v1/chat/completions", json=CHAT)
    await resp.read()
    assert seen == []  # held
    stats = await (await client.admin.get("/stats")).json()
    assert stats["totals"]["requests"] == 1
