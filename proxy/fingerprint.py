"""Prompt fingerprints: a request rendered to bytes, cut into blocks, hashed as a chain.

A request is rendered into the ordered segments the backend's chat template will see (model,
tools, system messages, then each message; or the completion prompt), serialized to one byte
string, cut into fixed-size blocks and hashed as a chain::

    h_0 = xxh3_64(model + "\\x00" + salt)               # the seed
    h_i = xxh3_64(block_i, seed=h_{i-1})               # one hash per full block

so two requests (same model, same salt) share their first k block hashes exactly when their
rendered bytes agree on the first k blocks. The trailing partial block is not hashed: it is
the part most likely to change on the next turn, and a partial block cannot be matched anyway.
The last ~1 KB of the bytes is kept on the fingerprint (``tail``, in memory only: never
logged, stored or shown) so that the slot model can find the exact byte where a next turn
parts from a prompt.
The salt (tenant / ``cache_salt``) and the model seed the chain, so tenants and models never
share an index entry.

Block size. ``DEFAULT_BLOCK_BYTES = 256`` is about 64 tokens at the ~4 bytes per token of
English text and code. It is fine enough that a predicted cache hit is wrong by less than one
block (≈ 64 tokens, a small fraction of the prompts that matter for caching), and coarse enough
that a 512 KB prompt is 2,048 hashes: a Python loop over C hashing stays in the hundreds of MB/s,
and the prefix lookup is one Redis ``ZMSCORE`` with a few thousand members at most.

Rendering. One control byte, ``\\x1e``, marks all structure: a segment ends with
``\\x1e\\x1c``, fields inside a message are separated by ``\\x1e\\x1f`` and content parts by
``\\x1e\\x1d``. Text that itself contains ``\\x1e`` has it doubled, so text can never forge a
boundary and the rendering is injective on the parts it covers (and escaping costs one memchr).
Text parts are rendered as their text; everything structured (tools, tool calls, non-text
content parts, values of unexpected types) as compact JSON, which never holds a raw control byte.

Key order. JSON is serialized with orjson **in the key order the client sent**, not sorted:
the fingerprint must reflect the bytes the backend's template will see, and a backend caches
exactly those. Two requests that differ only in the key order of their tool schemas therefore
fingerprint differently, which is right: they miss each other's cache. Making key order stable
is the canonicalizer's job (``proxy/canonical/``), and it runs before fingerprinting.

Cumulative segment hashes. Besides the block chain, a streaming xxh3 hasher (same seed) is
read at the end of every segment. These let the analyzer compare prompts at message
granularity from logs that carry no prompt text. The ``anchor`` is the cumulative hash at the
end of the stable part (model, tools and the leading system messages): requests with the same
anchor come from the same application prompt.

Rendering never raises on a JSON object body, whatever the types inside it and however deep it
nests: past orjson's 255 levels the stdlib encoder takes over, and past the interpreter's
recursion limit an iterative encoder (``proxy.deep_json``) that writes the same text.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Container, Hashable, Mapping, Sequence
from dataclasses import field
from typing import Any, NamedTuple, TypeVar

import orjson
import xxhash

from proxy.deep_json import deep_json
from proxy.values import value

K = TypeVar("K", bound=Hashable)

DEFAULT_BLOCK_BYTES = 256
TAIL_BLOCKS = 4  # full blocks kept as bytes before the partial one (``Fingerprint.tail``)

# One reserved byte marks all structure, so escaping text costs a single memchr scan:
# in rendered text it is doubled, and every separator is the reserved byte plus a tag byte.
RESERVED = b"\x1e"
SEGMENT_END = b"\x1e\x1c"
FIELD_SEP = b"\x1e\x1f"
PART_SEP = b"\x1e\x1d"
_ESCAPED = RESERVED + RESERVED
_END_LEN = len(SEGMENT_END)

CHAT_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions"})
COMPLETION_ROUTES = frozenset({"/v1/completions", "/completions", "/completion"})
RESPONSES_ROUTES = frozenset({"/v1/responses", "/responses"})
MESSAGES_ROUTES = frozenset({"/v1/messages"})
SYSTEM_ROLES = frozenset({"system", "developer"})

_xxh3 = xxhash.xxh3_64_intdigest


class Segment(NamedTuple):
    """One rendered segment: its kind and the byte offset where it starts.

    A named tuple rather than a dataclass: a long conversation creates hundreds per request.
    """

    kind: str  # "model" | "tools" | "system" | "message" | "prompt"
    start: int


@value
class Rendered:
    """A request as the byte string that gets hashed, with its segment boundaries."""

    data: bytes
    segments: tuple[Segment, ...]

    def segment_ends(self) -> tuple[int, ...]:
        """The end offset (exclusive) of every segment."""
        starts = [s.start for s in self.segments[1:]]
        return (*starts, len(self.data)) if self.segments else ()


@value
class Fingerprint:
    """The chained block hashes of one request, plus its per-segment cumulative hashes."""

    block_hashes: tuple[int, ...]
    block_bytes: int
    total_bytes: int
    segments: tuple[Segment, ...]
    segment_hashes: tuple[int, ...]
    anchor: int
    stable_bytes: int
    tail: bytes = field(default=b"", repr=False)
    """The prompt's last bytes from a block boundary: the trailing partial block and up to
    ``TAIL_BLOCKS`` full blocks before it. A conversation's next turn most often parts from
    this prompt there, and a later request finds the exact byte it parts at
    (``llamacpp_cache.TokenCounter``). It starts at ``total_bytes - len(tail)``."""

    def segment_ends(self) -> tuple[int, ...]:
        """The end offset (exclusive) of every segment."""
        starts = [s.start for s in self.segments[1:]]
        return (*starts, self.total_bytes) if self.segments else ()

    def segment_table(self) -> list[list[Any]]:
        """The ``prefix_segments`` record field: ``[[hex hash, end offset, kind], ...]``."""
        return [
            [hex64(h), end, seg.kind]
            for h, end, seg in zip(
                self.segment_hashes, self.segment_ends(), self.segments, strict=True
            )
        ]


def hex64(h: int) -> str:
    """A 64-bit hash as 16 lowercase hex digits."""
    return f"{h:016x}"


def chain_seed(model: str, salt: str = "") -> int:
    """The seed of a request's hash chain: the model name and the tenant salt."""
    return _xxh3(_utf8(model + "\x00" + salt))


def _utf8(text: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError:  # lone surrogates are valid in JSON strings
        return text.encode("utf-8", "surrogatepass")


def _text(text: str) -> bytes:
    """Text as bytes, with the separator bytes escaped so text cannot forge a boundary."""
    try:
        data = text.encode()
    except UnicodeEncodeError:  # lone surrogates are valid in JSON strings
        data = text.encode("utf-8", "surrogatepass")
    if RESERVED in data:
        data = data.replace(RESERVED, _ESCAPED)
    return data


def _json(value: Any) -> bytes:
    """Compact JSON in the order given (orjson; stdlib fallback for what orjson refuses)."""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        # Integers past 64 bits, lone surrogates, non-string keys, nesting past orjson's 255
        # levels: still render, never raise.
        try:
            out = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=repr)
        except RecursionError:  # nested deeper than the interpreter's stack (~1,000 levels)
            out = deep_json(value)
        return _utf8(out)


def _scalar(value: Any) -> bytes:
    """A string as escaped text, anything else as compact JSON."""
    return _text(value) if isinstance(value, str) else _json(value)


def _content(content: Any) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return _text(content)
    if isinstance(content, list):
        parts: list[bytes] = []
        for part in content:
            if isinstance(part, str):
                parts.append(_text(part))
            elif (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append(_text(part["text"]))
            else:
                parts.append(_json(part))
        return PART_SEP.join(parts)
    return _json(content)


_ROLES = {role: role.encode() for role in ("system", "developer", "user", "assistant", "tool")}


def _message(message: Any) -> tuple[str, bytes | tuple[bytes, ...]]:
    """A chat message as (segment kind, bytes without the segment terminator, or the parts
    that make them: a long message's text is not copied before the final join)."""
    if type(message) is not dict:
        return "message", _json(message)
    role = message.get("role")
    kind = "message"
    if type(role) is str:
        role_bytes = _ROLES.get(role) or _text(role)
        if role in SYSTEM_ROLES:
            kind = "system"
    else:
        role_bytes = b"" if role is None else _json(role)
    content = message.get("content")
    content_bytes = _text(content) if type(content) is str else _content(content)
    if len(message) <= 2 and "tool_calls" not in message:
        return kind, (role_bytes, FIELD_SEP, content_bytes)  # the common shape, fast path
    out = [role_bytes, FIELD_SEP, content_bytes]
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        out += (FIELD_SEP, b"T", _json(tool_calls))
    call_id = message.get("tool_call_id")
    if call_id is not None:
        out += (FIELD_SEP, b"I", _scalar(call_id))
    name = message.get("name")
    if name is not None:
        out += (FIELD_SEP, b"N", _scalar(name))
    return kind, b"".join(out)


class _Builder:
    """Appends segments and remembers where each starts."""

    __slots__ = ("chunks", "offset", "segments")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.segments: list[Segment] = []
        self.offset = 0

    def add(self, kind: str, payload: bytes | tuple[bytes, ...]) -> None:
        self.segments.append(Segment(kind, self.offset))
        if isinstance(payload, tuple):
            self.chunks += payload
            self.offset += sum(map(len, payload))
        else:
            self.chunks.append(payload)
            self.offset += len(payload)
        self.chunks.append(SEGMENT_END)
        self.offset += _END_LEN

    def build(self) -> Rendered:
        return Rendered(b"".join(self.chunks), tuple(self.segments))


def _render_chat(out: _Builder, body: Mapping[str, Any]) -> None:
    tools = body.get("tools")
    functions = body.get("functions")  # the legacy spelling of tools
    if tools is not None or functions is not None:
        payload = _json(tools) if functions is None else _json(tools) + FIELD_SEP + _json(functions)
        out.add("tools", payload)
    messages = body.get("messages")
    if isinstance(messages, list):
        add = out.add
        for message in messages:
            add(*_message(message))
    elif messages is not None:
        out.add("message", _json(messages))


def _render_prompt(out: _Builder, body: Mapping[str, Any]) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        return
    if isinstance(prompt, str):
        out.add("prompt", _text(prompt))
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        out.add("prompt", _json(prompt))  # one prompt given as token ids
    elif isinstance(prompt, list):
        for item in prompt:  # a batch of prompts (strings or token-id lists), or mixed
            out.add("prompt", _scalar(item))
    else:
        out.add("prompt", _json(prompt))


# Content parts rendered as their text: chat's, Responses' input and output text, Anthropic's.
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
CACHE_MARKER = "cache_control"


def _unmarked(value: Any) -> Any:
    """An object without its Anthropic ``cache_control`` breakpoint: the template never sees
    it, and clients move it to the newest message on every turn."""
    if type(value) is dict and CACHE_MARKER in value:
        return {k: v for k, v in value.items() if k != CACHE_MARKER}
    return value


def _parts(content: Any) -> bytes:
    """Content of the Responses and Messages APIs: a string, or parts (text parts as text)."""
    if type(content) is str:
        return _text(content)
    if not isinstance(content, list):
        return b"" if content is None else _json(content)
    out: list[bytes] = []
    for part in content:
        kind = part.get("type") if type(part) is dict else None
        if type(kind) is str and kind in _TEXT_PARTS and type(part.get("text")) is str:
            out.append(_text(part["text"]))
        else:
            out.append(_json(_unmarked(part)))
    return PART_SEP.join(out)


def _turn(item: Any) -> tuple[str, bytes]:
    """A Responses input item or an Anthropic message: a message as role and content, any
    other item (function call, call output, reasoning) as compact JSON."""
    if type(item) is not dict or "role" not in item or item.get("type", "message") != "message":
        return "message", _json(_unmarked(item))
    role = item.get("role")
    kind = "system" if type(role) is str and role in SYSTEM_ROLES else "message"
    return kind, _scalar(role) + FIELD_SEP + _parts(item.get("content"))


def _render_api(out: _Builder, body: Mapping[str, Any], *, responses: bool) -> None:
    """Responses: tools, ``instructions``, each ``input`` item. Messages: tools, ``system``,
    each message. The order in which the server's template prints them."""
    tools = body.get("tools")
    if tools is not None:
        out.add("tools", _json([_unmarked(t) for t in tools] if type(tools) is list else tools))
    system = body.get("instructions" if responses else "system")
    if system is not None:
        out.add("system", b"system" + FIELD_SEP + _parts(system))
    turns = body.get("input" if responses else "messages")
    if type(turns) is str:
        out.add("message", b"user" + FIELD_SEP + _text(turns))
    elif type(turns) is list:
        add = out.add
        for item in turns:
            add(*_turn(item))
    elif turns is not None:
        out.add("message", _json(turns))


def render(route: str, body: Mapping[str, Any]) -> Rendered:
    """Render a request body to the byte string the fingerprint hashes.

    Chat routes render model, tools, then each message; completion routes (OpenAI
    ``/v1/completions`` and llama.cpp's native ``/completion``) render model then the prompt;
    the Responses API model, tools, ``instructions``, then each ``input`` item, and the
    Anthropic Messages API model, tools, ``system``, then each message (``cache_control``
    markers left out: the template does not see them).
    Any other route is rendered by what the body holds (``messages`` or ``prompt``), and a body
    with neither as one compact-JSON prompt segment.
    """
    out = _Builder()
    model = body.get("model")
    out.add("model", b"" if model is None else _scalar(model))
    if route in CHAT_ROUTES:
        _render_chat(out, body)
    elif route in COMPLETION_ROUTES:
        _render_prompt(out, body)
    elif route in RESPONSES_ROUTES or route in MESSAGES_ROUTES:
        _render_api(out, body, responses=route in RESPONSES_ROUTES)
    elif "messages" in body:
        _render_chat(out, body)
    elif "prompt" in body:
        _render_prompt(out, body)
    else:
        rest = {k: v for k, v in body.items() if k != "model"}
        if rest:
            out.add("prompt", _json(rest))
    return out.build()


def _model_name(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        return ""
    if isinstance(model, str):
        return model
    return _json(model).decode("utf-8", "surrogatepass")


def block_chain(
    data: bytes | memoryview, seed: int, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> tuple[int, ...]:
    """The chained hashes of every full block of ``data``."""
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    view = memoryview(data)
    xxh3 = _xxh3
    h = seed
    # A comprehension with an assignment expression is the fastest chain loop in CPython.
    return tuple(
        [
            h := xxh3(view[off : off + block_bytes], h)
            for off in range(0, len(data) - block_bytes + 1, block_bytes)
        ]
    )


class ChainMemo:
    """The block chains of recent long prompts, so that a prompt sharing a long prefix with one
    of them hashes only what follows it.

    An agent or a chat resends its system prompt, tools and history every turn; at 512 KB the
    chain is 2,048 hash calls, most of the fingerprint's time. The segment hashes are cumulative
    (each covers the prompt from its first byte), so two prompts whose hashes agree at segment
    ``j`` agree on every byte up to its end: the earlier prompt's block hashes up to there are
    this one's. Entries are found by (segment count, segment hash), by bisection over the
    segment count (sharing ``j`` segments implies sharing fewer). Only hashes are kept (no
    prompt bytes); the seed is in every hash, so a tenant never reuses another's chain. Bounded
    to ``max_entries`` prompts of at least ``min_blocks`` blocks, most recent kept.
    """

    __slots__ = ("_entries", "_index", "max_entries", "min_blocks")

    def __init__(self, *, max_entries: int = 64, min_blocks: int = 64) -> None:
        self.max_entries = max_entries
        self.min_blocks = min_blocks
        self._entries: deque[tuple[tuple[int, ...], tuple[int, ...]]] = deque()
        self._index: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def reused(
        self, segment_hashes: Sequence[int], ends: Sequence[int], block_bytes: int
    ) -> tuple[int, ...]:
        """The leading block hashes a remembered prompt shares with this one (maybe none)."""
        index = self._index
        if not index or not segment_hashes:
            return ()
        lo, hi, found = 0, len(segment_hashes), None
        while lo < hi:  # the most leading segments some entry shares
            mid = (lo + hi + 1) // 2
            entry = index.get((mid, segment_hashes[mid - 1]))
            if entry is not None:
                lo, found = mid, entry
            else:
                hi = mid - 1
        if found is None:
            return ()
        chain, _ = found
        return chain[: min(ends[lo - 1] // block_bytes, len(chain))]

    def remember(self, segment_hashes: tuple[int, ...], chain: tuple[int, ...]) -> None:
        if len(chain) < self.min_blocks or not segment_hashes:
            return
        entry = (chain, segment_hashes)
        for j, h in enumerate(segment_hashes, 1):
            self._index[(j, h)] = entry
        self._entries.append(entry)
        while len(self._entries) > self.max_entries:
            old_chain, old_hashes = self._entries.popleft()
            for j, h in enumerate(old_hashes, 1):
                known = self._index.get((j, h))
                if known is not None and known[0] is old_chain:
                    del self._index[(j, h)]


def fingerprint(
    route: str,
    body: Mapping[str, Any],
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    salt: str = "",
) -> Fingerprint:
    """Fingerprint one request: its block hash chain, segment hashes and anchor."""
    return fingerprint_with_data(route, body, block_bytes=block_bytes, salt=salt)[0]


def fingerprint_with_data(
    route: str,
    body: Mapping[str, Any],
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    salt: str = "",
    memo: ChainMemo | None = None,
) -> tuple[Fingerprint, bytes]:
    """``fingerprint``, and the rendered bytes it hashed (for the request's own lifetime).

    ``memo``: recent chains to reuse the shared prefix of (the same hashes, fewer calls)."""
    rendered = render(route, body)
    fp = fingerprint_rendered(
        rendered, seed=chain_seed(_model_name(body), salt), block_bytes=block_bytes, memo=memo
    )
    return fp, rendered.data


def fingerprint_rendered(
    rendered: Rendered,
    *,
    seed: int,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    memo: ChainMemo | None = None,
) -> Fingerprint:
    """Fingerprint an already rendered request under a given chain seed (``memo``: see
    ``fingerprint_with_data``)."""
    data = rendered.data
    segments = rendered.segments
    ends = rendered.segment_ends()
    hasher = xxhash.xxh3_64(seed=seed)
    view = memoryview(data)
    segment_hashes: list[int] = []
    start = 0
    for end in ends:
        hasher.update(view[start:end])
        segment_hashes.append(hasher.intdigest())
        start = end
    # The stable part: model, tools and the system messages before the first other message.
    stable = 0
    for seg in segments:
        if seg.kind not in ("model", "tools", "system"):
            break
        stable += 1
    stable_bytes = ends[stable - 1] if stable else 0
    anchor = segment_hashes[stable - 1] if stable else seed
    if memo is None:
        blocks = block_chain(data, seed, block_bytes)
    else:
        seg_hashes = tuple(segment_hashes)
        head = memo.reused(seg_hashes, ends, block_bytes)
        if head:
            skip = len(head) * block_bytes
            blocks = head + block_chain(memoryview(data)[skip:], head[-1], block_bytes)
        else:
            blocks = block_chain(data, seed, block_bytes)
        memo.remember(seg_hashes, blocks)
    return Fingerprint(
        block_hashes=blocks,
        block_bytes=block_bytes,
        total_bytes=len(data),
        segments=segments,
        segment_hashes=tuple(segment_hashes),
        anchor=anchor,
        stable_bytes=stable_bytes,
        tail=data[max(len(blocks) - TAIL_BLOCKS, 0) * block_bytes :],
    )


def common_blocks(a: Sequence[int], b: Sequence[int], known: int = 0) -> int:
    """Leading blocks two chained-hash sequences share, given that they share ``known``.

    A chained hash commits to every block before it, so equal hashes at one position mean equal
    prefixes up to there, and the answer can be found by bisection.
    """
    lo, hi = known, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def leading_run(keys: Sequence[K], present: Container[K]) -> int:
    """How many leading ``keys`` are in ``present``, a prefix-closed set of chain keys.

    Binary search: ``O(log n)`` probes, and one for a chain whose first key is absent (the
    common answer for a replica that never saw the prompt). It is exact because presence is
    monotone along a chain: a prefix-closed index holds a key only with every key before it,
    and a chain that left the index at block k continues with keys it has never seen. The
    proxy's stores (the Redis lookup script runs the same search) and the analyzer's cache
    replays all use it, so they agree on every input.
    """
    hi = len(keys)
    if hi == 0 or keys[0] not in present:
        return 0
    lo = 1  # keys[:lo] are present; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if keys[mid - 1] in present:
            lo = mid
        else:
            hi = mid - 1
    return lo
