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
    plain, _, _ = await make_proxy(llama_fake.url)
    logging_prompts, records, _ = await make_proxy(llama_fake.url, log_prompts=True)
    configure_logging(log_file=str(log))
    try:
        for client, body in (
            (plain, chat("what is one plus one")),
            (plain, chat("what is two plus two", stream=True)),
            (logging_prompts, chat("what is three plus three", prompt_cache_key="thread-1")),
            (plain, {"model": "fake-model", "messages": "not a list"}),  # 400: a record too
        ):
            async with client.post("/v1/chat/completions", json=body) as resp:
                await resp.read()
        await records.wait(1)
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
