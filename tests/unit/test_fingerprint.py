"""The prompt fingerprint: rendering, the block hash chain, segment hashes and the anchor."""

from __future__ import annotations

from typing import Any

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.fingerprint import (
    DEFAULT_BLOCK_BYTES,
    SEGMENT_END,
    ChainMemo,
    block_chain,
    chain_seed,
    fingerprint,
    fingerprint_with_data,
    hex64,
    render,
)

CHAT = "/v1/chat/completions"
TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
    }
]


def chat(*messages: dict[str, Any], tools: Any = None, model: str = "m") -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": list(messages)}
    if tools is not None:
        body["tools"] = tools
    return body


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)
json_objects = st.dictionaries(
    st.sampled_from(["model", "messages", "tools", "prompt", "functions", "x", "content"])
    | st.text(max_size=8),
    json_values,
    max_size=6,
)


def test_default_block_size_is_256_bytes() -> None:
    """Blocks are 256 bytes (about 64 tokens) unless asked otherwise."""
    assert DEFAULT_BLOCK_BYTES == 256
    fp = fingerprint(CHAT, chat({"role": "user", "content": "x" * 1000}))
    assert fp.block_bytes == 256
    assert len(fp.block_hashes) == fp.total_bytes // 256


def test_chain_matches_definition() -> None:
    """h_i = xxh3_64(block_i, seed=h_{i-1}) seeded by xxh3_64(model NUL salt)."""
    body = chat({"role": "user", "content": "hello world " * 100})
    fp = fingerprint(CHAT, body, block_bytes=64, salt="tenant-a")
    data = render(CHAT, body).data
    h = xxhash.xxh3_64_intdigest(b"m\x00tenant-a")
    expected = []
    for i in range(len(data) // 64):
        h = xxhash.xxh3_64_intdigest(data[i * 64 : (i + 1) * 64], seed=h)
        expected.append(h)
    assert fp.block_hashes == tuple(expected)
    assert chain_seed("m", "tenant-a") == xxhash.xxh3_64_intdigest(b"m\x00tenant-a")


def test_trailing_partial_block_not_hashed() -> None:
    """A prompt shorter than one block has no block hashes at all."""
    fp = fingerprint(CHAT, chat({"role": "user", "content": "hi"}))
    assert fp.block_hashes == ()
    assert fp.total_bytes < DEFAULT_BLOCK_BYTES


def test_salt_and_model_separate_chains() -> None:
    """Different salts or models share no block hash even for identical prompts."""
    body = chat({"role": "user", "content": "same text " * 200})
    base = fingerprint(CHAT, body)
    salted = fingerprint(CHAT, body, salt="other")
    other_model = fingerprint(CHAT, {**body, "model": "m2"})
    assert not set(base.block_hashes) & set(salted.block_hashes)
    assert base.block_hashes[0] != other_model.block_hashes[0]


def test_segments_kinds_and_offsets() -> None:
    """Segments are model, tools, system, then messages, each starting at its byte offset."""
    body = chat(
        {"role": "system", "content": "S"},
        {"role": "developer", "content": "D"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c1", "name": "lookup", "content": "R"},
        tools=TOOLS,
    )
    rendered = render(CHAT, body)
    kinds = [s.kind for s in rendered.segments]
    assert kinds == ["model", "tools", "system", "system", "message", "message", "message"]
    ends = rendered.segment_ends()
    for seg, end in zip(rendered.segments, ends, strict=True):
        assert rendered.data[end - len(SEGMENT_END) : end] == SEGMENT_END
        assert seg.start < end
    assert rendered.segments[0].start == 0
    assert ends[-1] == len(rendered.data)
    user = rendered.data[rendered.segments[4].start : ends[4]]
    assert user.startswith(b"user") and b"U" in user
    tool = rendered.data[rendered.segments[6].start : ends[6]]
    assert b"c1" in tool and b"lookup" in tool and b"R" in tool


def test_segment_hashes_are_cumulative_prefix_hashes() -> None:
    """segment_hashes[i] is the seeded xxh3 of the data up to the end of segment i."""
    body = chat({"role": "system", "content": "S" * 300}, {"role": "user", "content": "U"})
    fp = fingerprint(CHAT, body, salt="t")
    data = render(CHAT, body).data
    seed = chain_seed("m", "t")
    for h, end in zip(fp.segment_hashes, fp.segment_ends(), strict=True):
        assert h == xxhash.xxh3_64_intdigest(data[:end], seed=seed)
    table = fp.segment_table()
    assert [row[2] for row in table] == ["model", "system", "message"]
    assert table[-1][1] == fp.total_bytes


def test_anchor_covers_model_tools_and_leading_system() -> None:
    """The anchor is the hash at the end of the leading system messages, whatever follows."""
    sys_msg = {"role": "system", "content": "You are a bot."}
    a = fingerprint(CHAT, chat(sys_msg, {"role": "user", "content": "one"}, tools=TOOLS))
    b = fingerprint(CHAT, chat(sys_msg, {"role": "user", "content": "two"}, tools=TOOLS))
    c = fingerprint(CHAT, chat({"role": "system", "content": "Other."}, tools=TOOLS))
    assert a.anchor == b.anchor != c.anchor
    assert a.anchor == a.segment_hashes[2]
    assert a.stable_bytes == a.segment_ends()[2]
    late_system = fingerprint(CHAT, chat({"role": "user", "content": "u"}, sys_msg))
    assert late_system.anchor == late_system.segment_hashes[0]


def test_tool_key_order_changes_fingerprint() -> None:
    """Tools are hashed in the client's key order: a reordered schema is a different prompt."""
    shuffled = [{"function": TOOLS[0]["function"], "type": "function"}]
    msg = {"role": "user", "content": "x" * 600}
    a = fingerprint(CHAT, chat(msg, tools=TOOLS), block_bytes=16)
    b = fingerprint(CHAT, chat(msg, tools=shuffled), block_bytes=16)
    assert a.block_hashes[-1] != b.block_hashes[-1]
    assert a.anchor != b.anchor


def test_text_parts_render_like_plain_content() -> None:
    """A single text part renders exactly like the same string content."""
    a = render(CHAT, chat({"role": "user", "content": "hello"}))
    b = render(CHAT, chat({"role": "user", "content": [{"type": "text", "text": "hello"}]}))
    img = render(CHAT, chat({"role": "user", "content": [{"type": "image_url", "url": "u"}]}))
    assert a.data == b.data
    assert b'"image_url"' in img.data


def test_text_cannot_forge_a_segment_boundary() -> None:
    """Control bytes inside text are escaped, so one message never renders like two."""
    one = render(CHAT, chat({"role": "user", "content": "a\x1e\x1cuser\x1e\x1fb"}))
    two = render(CHAT, chat({"role": "user", "content": "a"}, {"role": "user", "content": "b"}))
    assert one.data != two.data
    assert len(one.segments) == 2


def test_completion_prompts() -> None:
    """Completion prompts render as text, token ids or a batch, on both completion routes."""
    text = render("/v1/completions", {"model": "m", "prompt": "once upon"})
    native = render("/completion", {"prompt": "once upon"})
    ids = render("/completion", {"prompt": [1, 2, 3]})
    batch = render("/v1/completions", {"model": "m", "prompt": ["a", [1, 2]]})
    assert text.data.endswith(b"once upon" + SEGMENT_END)
    assert native.data.endswith(b"once upon" + SEGMENT_END)
    assert b"[1,2,3]" in ids.data
    assert [s.kind for s in batch.segments] == ["model", "prompt", "prompt"]
    only_model = fingerprint("/v1/completions", {"prompt": "x" * 300})
    assert only_model.anchor == only_model.segment_hashes[0]


def test_odd_shapes_render() -> None:
    """Unexpected types render via compact JSON instead of raising."""
    odd: list[dict[str, Any]] = [
        {"model": 7, "messages": "not a list"},
        {"messages": [3, None, {"role": ["x"], "content": 5}]},
        {"messages": [{"role": "user", "content": {"type": "text"}}]},
        {"prompt": {"prompt_string": "x", "multimodal_data": []}},
        {"something": "else"},
        {},
        {"messages": [{"role": "user", "content": "\ud800"}]},
        {"messages": [{"role": "user", "content": [2**70]}]},
    ]
    for body in odd:
        for route in (CHAT, "/v1/completions", "/other"):
            fp = fingerprint(route, body)
            assert fp.segments[0].kind == "model"
            assert fp.segment_ends()[-1] == fp.total_bytes


def test_hex64_is_16_digits() -> None:
    """hex64 pads to 16 lowercase hex digits."""
    assert hex64(0) == "0" * 16
    assert hex64(0xABC) == "0000000000000abc"
    assert hex64(2**64 - 1) == "f" * 16


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=600), st.binary(max_size=600), st.binary(max_size=600))
def test_equal_prefixes_iff_equal_leading_hashes(common: bytes, a: bytes, b: bytes) -> None:
    """Two byte strings share their first k block hashes exactly when they share k blocks."""
    block = 32
    da, db = common + a, common + b
    ha, hb = block_chain(da, 1, block), block_chain(db, 1, block)
    shared_blocks = 0
    while (shared_blocks + 1) * block <= min(len(da), len(db)) and da[
        shared_blocks * block : (shared_blocks + 1) * block
    ] == db[shared_blocks * block : (shared_blocks + 1) * block]:
        shared_blocks += 1
    k = 0
    while k < min(len(ha), len(hb)) and ha[k] == hb[k]:
        k += 1
    assert k == shared_blocks


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=1, max_size=800), st.data())
def test_change_at_byte_k_changes_hashes_from_its_block(text: str, data: st.DataObject) -> None:
    """Changing rendered byte k changes every block hash from block k // B on and none before."""
    block = 16
    body = chat({"role": "user", "content": text})
    rendered = render(CHAT, body)
    content_start = rendered.segments[1].start + len(b"user\x1e\x1f")
    index = data.draw(st.integers(0, len(text) - 1))
    replacement = "Z" if text[index] != "Z" else "Y"
    changed = text[:index] + replacement + text[index + 1 :]
    head = text[:index].encode("utf-8", "surrogatepass").replace(b"\x1e", b"\x1e\x1e")
    k = content_start + len(head)
    before = fingerprint(CHAT, body, block_bytes=block).block_hashes
    after = fingerprint(CHAT, chat({"role": "user", "content": changed}), block_bytes=block)
    first = k // block
    assert before[:first] == after.block_hashes[:first]
    n = min(len(before), len(after.block_hashes))
    assert all(before[i] != after.block_hashes[i] for i in range(first, n))


@settings(max_examples=200, deadline=None)
@given(json_objects, st.sampled_from([CHAT, "/v1/completions", "/completion", "/x"]))
def test_never_raises_and_is_deterministic(body: dict[str, Any], route: str) -> None:
    """Any JSON object fingerprints without raising, and twice gives the same result."""
    a = fingerprint(route, body, block_bytes=8)
    b = fingerprint(route, body, block_bytes=8)
    assert a == b
    assert len(a.block_hashes) == a.total_bytes // 8
    assert len(a.segment_hashes) == len(a.segments)
    assert a.segment_ends()[-1] == a.total_bytes


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text()}
        ),
        max_size=6,
    )
)
def test_segment_offsets_partition_the_data(messages: list[dict[str, Any]]) -> None:
    """Segments tile the rendered bytes in order and each ends with the segment terminator."""
    rendered = render(CHAT, chat(*messages))
    starts = [s.start for s in rendered.segments]
    assert starts == sorted(starts) and starts[0] == 0
    assert len(rendered.segments) == 1 + len(messages)
    for end in rendered.segment_ends():
        assert rendered.data[end - 2 : end] == SEGMENT_END


# -- the chain memo ------------------------------------------------------------------------------


def _conversation(system: str, turns: list[str], salt_model: str = "m") -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": salt_model, "messages": messages}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # which system prompt
            st.lists(st.text(max_size=300), max_size=6),  # the turns
            st.sampled_from(["", "team-a"]),  # the tenant salt
            st.sampled_from(["m", "other-model"]),
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([16, 64, 256]),
)
def test_a_memo_never_changes_a_fingerprint(
    requests: list[tuple[int, list[str], str, str]], block_bytes: int
) -> None:
    """Whatever was remembered, a fingerprint with the memo is the one without it."""
    systems = ["policy " * 600, "policy " * 600 + "and more", "other " * 700]
    memo = ChainMemo(max_entries=4, min_blocks=2)
    for which, turns, salt, model in requests:
        body = _conversation(systems[which], turns, model)
        plain, _ = fingerprint_with_data(CHAT, body, block_bytes=block_bytes, salt=salt)
        memoized, _ = fingerprint_with_data(
            CHAT, body, block_bytes=block_bytes, salt=salt, memo=memo
        )
        assert memoized == plain
    assert len(memo) <= 4


def test_a_memo_reuses_the_shared_prefix_of_the_next_turn() -> None:
    memo = ChainMemo()
    first = _conversation("rules " * 20_000, ["hello"])
    fp1, _ = fingerprint_with_data(CHAT, first, memo=memo)
    second = _conversation("rules " * 20_000, ["hello", "hi there", "and now?"])
    assert len(memo.reused(*_segments(second), 256)) >= len(fp1.block_hashes) - 2
    other_tenant = memo.reused(*_segments(second, salt="team-b"), 256)
    assert other_tenant == ()  # the salt is in every hash: nothing is shared across tenants


def _segments(body: dict[str, Any], salt: str = "") -> tuple[tuple[int, ...], tuple[int, ...]]:
    fp, _ = fingerprint_with_data(CHAT, body, salt=salt)
    return fp.segment_hashes, fp.segment_ends()
