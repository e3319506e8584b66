"""Record derivation: latencies, SLO verdicts, savings, and the writer's sinks."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from proxy.record_writer import RecordWriter
from proxy.records import (
    Observation,
    Pricing,
    RecordBuilder,
    RequestRecord,
    Slo,
    derive_latencies,
)


def obs(**kw: float | int | None) -> Observation:
    return Observation(t_start=100.0, **kw)  # type: ignore[arg-type]


def test_stream_latencies_observed() -> None:
    """Streams: TTFT, TTFVT from the proxy's clock; TPOT spans first→last over n-1 tokens."""
    o = obs(t_first_token=100.2, t_first_visible=100.5, t_last_token=101.2, completion_tokens=11)
    ttft, ttfvt, tpot, source = derive_latencies(o, stream=True)
    assert (ttft, ttfvt, tpot, source) == (200.0, 500.0, 100.0, "observed")


def test_stream_tpot_falls_back_to_event_count() -> None:
    """Without a usage count, TPOT uses the number of token events; one token gives none."""
    o = obs(t_first_token=100.1, t_last_token=100.5, token_events=5)
    assert derive_latencies(o, stream=True)[2] == 100.0
    single = obs(t_first_token=100.1, t_last_token=100.1, token_events=1, completion_tokens=1)
    assert derive_latencies(single, stream=True)[2] is None


def test_non_stream_uses_backend_decode_time() -> None:
    """Non-streamed: TTFT is end-to-end minus the backend's decode time; TPOT the backend's."""
    o = obs(t_end=101.0, backend_decode_ms=700.0, backend_tpot_ms=20.0)
    assert derive_latencies(o, stream=False) == (300.0, None, 20.0, "backend")
    assert derive_latencies(obs(t_end=101.0), stream=False) == (None, None, None, "none")


@pytest.mark.parametrize(
    "slo,status,ttft,tpot,met",
    [
        (Slo(), 200, 1.0, 1.0, None),
        (Slo(ttft_ms=100), 200, 99.0, None, True),
        (Slo(ttft_ms=100), 200, 101.0, None, False),
        (Slo(ttft_ms=100), 200, None, None, False),
        (Slo(tpot_ms=10), 200, None, 11.0, False),
        (Slo(tpot_ms=10), 200, None, None, True),
        (Slo(ttft_ms=100), 500, 1.0, None, False),
    ],
)
def test_slo(
    slo: Slo, status: int, ttft: float | None, tpot: float | None, met: bool | None
) -> None:
    """The SLO is met only by a success within every configured bound."""
    assert slo.met(status, ttft, tpot) is met


def test_pricing() -> None:
    """Savings are cached tokens times the price difference; unknown without a price or count."""
    p = Pricing(input_per_mtok=3.0, cached_input_per_mtok=0.3)
    assert p.saved_usd(1_000_000) == pytest.approx(2.7)
    assert p.saved_usd(None) is None
    assert Pricing().saved_usd(100) is None


def build(builder: RecordBuilder, o: Observation, **kw: object) -> RequestRecord:
    args: dict[str, object] = {
        "ts": "t",
        "request_id": "r",
        "route": "/v1/chat/completions",
        "model": "m",
        "backend": "http://b",
        "dialect": "llamacpp",
        "stream": True,
        "status": 200,
        "error": None,
    }
    args.update(kw)
    return builder.build(o, **args)  # type: ignore[arg-type]


def test_builder_cached_source_and_saved_ms() -> None:
    """Cached tokens: null is 'unknown', a number is 'reported'; savings follow prefill rate."""
    b = RecordBuilder(slo=Slo(), pricing=Pricing())
    first = build(
        b, obs(t_end=101.0, prompt_tokens=1000, cached_tokens=0, backend_prefill_ms=500.0)
    )
    assert (first.cached_tokens, first.cached_tokens_source) == (0, "reported")
    second = build(b, obs(t_end=101.0, prompt_tokens=1000, cached_tokens=800))
    assert second.saved_prefill_ms == pytest.approx(400.0)  # 0.5 ms per token learned above
    unknown = build(b, obs(t_end=101.0, prompt_tokens=1000))
    assert (unknown.cached_tokens, unknown.cached_tokens_source) == (None, "unknown")
    assert unknown.saved_prefill_ms is None


def test_builder_error_misses_slo_and_overhead() -> None:
    """An errored record misses a configured SLO; overhead is body-read→forward plus inspection."""
    b = RecordBuilder(slo=Slo(ttft_ms=10_000), pricing=Pricing())
    o = obs(
        t_body_read=100.001, t_forward=100.003, t_first_token=100.1, t_end=100.2, inspect_s=0.0005
    )
    rec = build(b, o, error="backend_timeout")
    assert rec.slo_met is False
    assert rec.proxy_overhead_ms == pytest.approx(2.5)
    assert rec.e2e_ms == pytest.approx(200.0)


def test_the_slo_is_judged_on_the_first_visible_token() -> None:
    """A reasoning stream: its first token is in time, its first visible one is not. Goodput
    counts what the user waited for; a stream that never showed anything misses the SLO."""
    b = RecordBuilder(slo=Slo(ttft_ms=500), pricing=Pricing())
    thinking = obs(t_first_token=100.1, t_first_visible=100.9, t_last_token=101.0, t_end=101.0)
    rec = build(b, thinking)
    assert (rec.ttft_ms, rec.ttfvt_ms, rec.slo_met) == (100.0, 900.0, False)
    plain = obs(t_first_token=100.1, t_first_visible=100.1, t_last_token=101.0, t_end=101.0)
    assert build(b, plain).slo_met is True
    only_thinking = obs(t_first_token=100.1, t_last_token=101.0, t_end=101.0)
    assert build(b, only_thinking).slo_met is False
    whole = obs(t_end=100.3, backend_decode_ms=100.0)
    assert build(b, whole, stream=False).slo_met is True  # derived TTFT: 200 ms


def test_record_as_dict_is_flat() -> None:
    """as_dict is flat: every field, the fields set only when they apply, no 'extra' key."""
    rec = RequestRecord(
        ts="t",
        request_id="r",
        route="/x",
        model=None,
        backend=None,
        stream=False,
        status=200,
        prefix_matched_blocks=3,
    )
    d = rec.as_dict()
    assert d["prefix_matched_blocks"] == 3 and "extra" not in d
    assert d["cached_tokens"] is None and d["cached_tokens_source"] == "unknown"


async def test_writer_sinks_sync_async_and_failing() -> None:
    """Sinks get each record; async ones run in the background; a failing one breaks nothing."""
    writer = RecordWriter(logger=structlog.get_logger("t"))
    seen: list[str] = []
    done = asyncio.Event()

    def broken(rec: RequestRecord) -> None:
        raise RuntimeError("sink down")

    async def slow(rec: RequestRecord) -> None:
        await asyncio.sleep(0.01)
        seen.append("async:" + rec.request_id)
        done.set()

    writer.add_sink(broken)
    writer.add_sink(lambda rec: seen.append("sync:" + rec.request_id))
    writer.add_sink(slow)
    writer.emit(
        RequestRecord(
            ts="t", request_id="r1", route="/x", model=None, backend=None, stream=False, status=200
        )
    )
    assert seen == ["sync:r1"]
    await writer.drain()
    assert seen == ["sync:r1", "async:r1"]
    assert not writer.pending


async def test_writer_learners_get_the_stages_after_the_sinks() -> None:
    """Learners get record and stages, after every sink; without stages they are not called."""
    writer: RecordWriter[str] = RecordWriter(logger=structlog.get_logger("t"))
    seen: list[str] = []

    def broken(rec: RequestRecord, stages: str) -> None:
        raise RuntimeError("learner down")

    async def learn(rec: RequestRecord, stages: str) -> None:
        seen.append(f"learned:{rec.request_id}:{stages}")

    writer.add_learner(broken)
    writer.add_learner(learn)
    writer.add_sink(lambda rec: seen.append("sink:" + rec.request_id))

    def record(request_id: str) -> RequestRecord:
        return RequestRecord(
            ts="t", request_id=request_id, route="/x", model=None, backend=None, stream=False,
            status=200,
        )  # fmt: skip

    writer.emit(record("r1"), "exchange-1")
    writer.emit(record("r2"))
    await writer.drain()
    assert seen == ["sink:r1", "sink:r2", "learned:r1:exchange-1"]
    assert not writer.pending


def _record(request_id: str) -> RequestRecord:
    return RequestRecord(
        ts="t", request_id=request_id, route="/x", model=None, backend=None, stream=False,
        status=200,
    )  # fmt: skip


async def test_records_wait_a_moment_to_go_together_in_the_order_they_ended() -> None:
    """``submit``: a record, even of a request that ended alone, is held and built with the
    others that end meanwhile, ``BATCH_DELAY_S`` after the first (never inside the handler
    that hands it over), in the order the requests ended; a full batch goes in the loop's
    next turn; ``at_once`` (a request cut short at shutdown) sends what is held and itself."""
    writer: RecordWriter[str] = RecordWriter(logger=structlog.get_logger("t"))
    seen: list[str] = []
    writer.add_sink(lambda rec: seen.append(rec.request_id))
    writer.add_learner(lambda rec, stages: seen.append(f"learned:{stages}"))
    writer.BATCH_DELAY_S = 0.05  # (longer than any stall of a loaded machine's loop)
    writer.submit(lambda: _record("alone"), "s0")
    assert seen == []  # held: the client's next request may be arriving
    await asyncio.sleep(0)
    assert seen == []  # (not in the loop's next turn either)
    await asyncio.sleep(writer.BATCH_DELAY_S * 3)
    assert seen == ["alone", "learned:s0"]  # the timer sent it
    seen.clear()
    writer.submit(lambda: _record("a"), "s1")
    writer.submit(lambda: _record("b"), "s2")
    assert seen == []  # held
    await asyncio.sleep(writer.BATCH_DELAY_S * 3)
    assert seen == ["a", "learned:s1", "b", "learned:s2"]  # one timer sent both
    seen.clear()
    for i in range(RecordWriter.BATCH_MAX):
        writer.submit(lambda i=i: _record(f"r{i}"))  # type: ignore[misc]
    assert seen == []  # (not inside the handler that filled the batch)
    await asyncio.sleep(0)
    assert len(seen) == RecordWriter.BATCH_MAX  # a full batch goes in the loop's next turn
    seen.clear()
    writer.submit(lambda: _record("c"))
    writer.submit(lambda: _record("cut"), at_once=True)
    assert seen == ["c", "cut"]
    writer.submit(lambda: _record("late"))
    await writer.drain()  # drain writes what is held
    assert seen[-1] == "late" and not writer.pending
    writer.submit(lambda: _record("held"))
    await writer.drain(final=True)  # shutdown
    assert seen[-1] == "held"
    writer.submit(lambda: _record("after"))  # a handler still ending: no timer to wait for
    assert seen[-1] == "after"


async def test_held_records_wait_while_a_request_has_no_token_out() -> None:
    """At their moment, held records wait on while some request has no token out yet (what
    runs now comes between it and its first token), but never past ``HOLD_MAX_S``."""
    writer: RecordWriter[str] = RecordWriter(logger=structlog.get_logger("t"))
    seen: list[str] = []
    writer.add_sink(lambda rec: seen.append(rec.request_id))
    awaiting = [True]
    writer.hold_while(lambda: awaiting[0])
    writer.HOLD_MAX_S = 60.0  # (first: the hold alone, however slow the machine)
    writer.submit(lambda: _record("a"))
    await asyncio.sleep(RecordWriter.BATCH_DELAY_S * 2)
    assert seen == []  # its moment came while a request had no token out
    awaiting[0] = False
    await asyncio.sleep(RecordWriter.BATCH_DELAY_S)
    assert seen == ["a"]  # once it had
    writer.HOLD_MAX_S = RecordWriter.HOLD_MAX_S
    awaiting[0] = True
    writer.submit(lambda: _record("b"))
    await asyncio.sleep(RecordWriter.HOLD_MAX_S + RecordWriter.BATCH_DELAY_S * 2)
    assert seen == ["a", "b"]  # requests arriving all the time: no longer than HOLD_MAX_S

    def broken() -> bool:
        raise RuntimeError("check failed")

    writer.hold_while(broken)
    writer.submit(lambda: _record("c"))
    await asyncio.sleep(RecordWriter.BATCH_DELAY_S * 3)
    assert seen == ["a", "b", "c"]  # a broken check holds nothing


async def test_a_held_record_is_built_in_its_own_requests_context() -> None:
    """Each held record is built and emitted with its own request's bound context (log lines
    of its learners name its request), and one that cannot be built costs only itself."""
    writer = RecordWriter(logger=structlog.get_logger("t"))
    built: list[object] = []

    def build(request_id: str) -> RequestRecord:
        built.append(structlog.contextvars.get_contextvars().get("request_id"))
        return _record(request_id)

    def broken() -> RequestRecord:
        raise RuntimeError("no record")

    seen: list[str] = []
    writer.add_sink(lambda rec: seen.append(rec.request_id))
    for rid in ("r1", "r2"):
        structlog.contextvars.bind_contextvars(request_id=rid)
        writer.submit(lambda rid=rid: build(rid))  # type: ignore[misc]
        writer.submit(broken)
    structlog.contextvars.clear_contextvars()
    with structlog.testing.capture_logs() as logs:
        await writer.drain()
    assert built == ["r1", "r2"] and seen == ["r1", "r2"]
    failed = [e for e in logs if e["event"] == "record_failed"]
    assert len(failed) == 2 and [e["request_id"] for e in logs if e["event"] == "request"] == [
        "r1",
        "r2",
    ]


async def test_a_record_that_fails_to_go_out_costs_only_itself() -> None:
    """A record whose emission fails (a sink's bug is caught already; here the line itself)
    is logged and dropped; the rest of its batch still goes, and the request that flushes
    the batch is not failed by another's record."""
    writer = RecordWriter(logger=structlog.get_logger("t"))
    seen: list[str] = []
    writer.add_sink(lambda rec: seen.append(rec.request_id))

    class Unwritable(RequestRecord):
        def as_dict(self) -> dict[str, object]:
            raise ValueError("unserializable")

    bad = Unwritable(
        ts="t", request_id="bad", route="/x", model=None, backend=None, stream=False, status=200
    )
    writer.submit(lambda: _record("a"))
    writer.submit(lambda: bad)
    with structlog.testing.capture_logs() as logs:
        writer.submit(lambda: _record("c"), at_once=True)
        await writer.drain()
    assert seen == ["a", "c"]
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["record_failed"]


def test_a_records_arrival_is_written_in_utc_with_milliseconds() -> None:
    from proxy.timestamps import iso_ms

    assert iso_ms(0.0) == "1970-01-01T00:00:00.000Z"
    assert iso_ms(1796533390.4559) == "2026-12-06T05:03:10.455Z"
