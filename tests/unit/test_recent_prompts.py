"""The index of recent prompts answers what a scan with ``TokenCounter.shared`` answers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.backends.llamacpp_tokens import CachedPrompt, PromptQuery, TokenCounter
from proxy.fingerprint import fingerprint
from proxy.scheduling.slot_state import RecentPrompts

TEXTS = ["system rules " * 30, "hello", "tool result " * 40, "answer " * 25, "more please"]


def _body(turns: list[int]) -> dict[str, object]:
    roles = ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    return {
        "model": "m",
        "messages": [{"role": roles[i], "content": TEXTS[t]} for i, t in enumerate(turns)],
    }


def _state(turns: list[int], segmented: bool) -> CachedPrompt:
    fp = fingerprint("/v1/chat/completions", _body(turns), block_bytes=64)
    return CachedPrompt(hashes=fp.block_hashes, prompt_tokens=100.0, fp=fp if segmented else None)


def _query(state: CachedPrompt) -> PromptQuery:
    return PromptQuery(state.hashes, state.prompt_tokens, 16.0, state.fp)


def _scan(recent: list[CachedPrompt], q: PromptQuery, exclude: CachedPrompt | None) -> object:
    counter = TokenCounter()
    for other in reversed(recent):
        if other is not exclude and counter.shared(other, q).continues:
            return other
    return None


prompts = st.lists(st.integers(0, len(TEXTS) - 1), min_size=1, max_size=7)


@settings(max_examples=200, deadline=None)
@given(
    history=st.lists(st.tuples(prompts, st.booleans()), min_size=0, max_size=30),
    asked=st.tuples(prompts, st.booleans()),
    maxlen=st.integers(1, 12),
    exclude_last=st.booleans(),
)
def test_continued_by_matches_a_scan(
    history: list[tuple[list[int], bool]],
    asked: tuple[list[int], bool],
    maxlen: int,
    exclude_last: bool,
) -> None:
    recent = RecentPrompts(maxlen)
    kept: list[CachedPrompt] = []
    for turns, segmented in history:
        state = _state(turns, segmented)
        recent.append(state)
        kept = [*kept, state][-maxlen:]
    assert list(recent) == kept and len(recent) == len(kept)
    q = _query(_state(*asked))
    exclude = kept[-1] if exclude_last and kept else None
    assert recent.continued_by(q, exclude=exclude) is _scan(kept, q, exclude)


def test_the_newest_continued_prompt_wins_and_forgotten_ones_are_gone() -> None:
    recent = RecentPrompts(2)
    old, new = _state([0, 1], True), _state([0, 1], True)
    recent.append(old)
    recent.append(new)
    q = _query(_state([0, 1, 3, 4], True))
    assert recent.continued_by(q) is new
    assert recent.continued_by(q, exclude=new) is old
    recent.append(_state([2], True))
    assert recent.continued_by(q, exclude=new) is None
