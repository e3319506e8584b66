"""Prompt states of a llama.cpp replica and the tokens a request shares with one.

The proxy has no tokenizer on the request path. ``CachedPrompt`` is one prompt state the
server holds (in a slot or its RAM cache), ``PromptQuery`` the request being placed, and
``TokenCounter`` turns a match between the two into tokens. The rules of the server that decide
which state a request meets are ``llamacpp_cache``'s.

The model works on the request's fingerprint (chained block hashes and cumulative per-segment
hashes) and counts tokens with the backend's own numbers once a response reports them: a
prompt that *continues* a cached state (every segment of the state is a leading segment of the
prompt) shares exactly that state's
measured prompt tokens plus the share of its generated tokens that the next turn repeats
(``answer_reuse``, learned); any other match ends at a segment or block boundary, whose token
count is learned from the backend's measured ``cached_tokens`` the first time a request ends its
match there (``BoundaryTokens``), and estimated from the byte count until then. A match that runs
on inside a segment parts somewhere in the block after the last one both share. When that block
is among the state's last ~1 KB (``Fingerprint.tail``, where a next turn most often parts: a
grown or edited last message) the request's own bytes give the exact byte; otherwise the block's
middle is taken. Such a match is then counted back from the state's measured end when less of
the state is left than shared: its measured tokens, less the text after the match, less the
template's close of turn (``closing``, learned: 5 tokens in ChatML).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from proxy.fingerprint import SEGMENT_END, Fingerprint, common_blocks
from proxy.values import value

_END_LEN = len(SEGMENT_END)
MAX_CLOSING = 16.0  # tokens: a chat template's close of turn and generation prompt, at most


class CachedPrompt:
    """One prompt state the server holds, in a slot or in its RAM cache.

    Compared by identity, as the model's memos and the RAM cache's scans need. ``tokens`` is
    kept as a plain attribute, recomputed whenever ``prompt_tokens`` or ``generated`` is set:
    the RAM cache sums it over every entry at each save, and the model reads it in every match.
    """

    __slots__ = (
        "_generated",
        "_prompt_tokens",
        "continued",
        "fp",
        "gap_s",
        "hashes",
        "measured",
        "t_used",
        "tokens",
    )

    def __init__(
        self,
        hashes: tuple[int, ...],
        prompt_tokens: float,
        fp: Fingerprint | None = None,
        generated: float = 0.0,
        measured: bool = False,
        t_used: float = 0.0,
        gap_s: float | None = None,
        continued: bool = False,
    ) -> None:
        self.hashes = hashes
        self._prompt_tokens = prompt_tokens
        self.fp = fp
        self._generated = generated
        self.tokens: float = prompt_tokens + max(generated - 1.0, 0.0)
        """What the KV holds: the prompt and the generated tokens but the last sampled one
        (derived: set ``prompt_tokens`` or ``generated``, never this)."""
        self.measured = measured
        self.t_used = t_used
        self.gap_s: float | None = gap_s
        """Seconds between the state this one continued and this one's request (a
        conversation's pace); None when it continued nothing seen."""
        self.continued = continued
        """A later request continued it (it is a turn of a conversation)."""

    @property
    def prompt_tokens(self) -> float:
        """The prompt's tokens: estimated from its bytes, then the backend's ``prompt_tokens``."""
        return self._prompt_tokens

    @prompt_tokens.setter
    def prompt_tokens(self, value: float) -> None:
        self._prompt_tokens = value
        self.tokens = value + max(self._generated - 1.0, 0.0)

    @property
    def generated(self) -> float:
        """Tokens generated after the prompt (the backend's ``completion_tokens``) that the KV
        keeps."""
        return self._generated

    @generated.setter
    def generated(self, value: float) -> None:
        self._generated = value
        self.tokens = self._prompt_tokens + max(value - 1.0, 0.0)

    def measure(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """The backend's figures for the request that left this state."""
        if prompt_tokens:
            self.prompt_tokens = float(prompt_tokens)
            self.measured = True
        if completion_tokens is not None:
            self.generated = float(completion_tokens)

    def __repr__(self) -> str:
        return (
            f"CachedPrompt(blocks={len(self.hashes)}, prompt_tokens={self._prompt_tokens}, "
            f"generated={self._generated}, measured={self.measured}, t_used={self.t_used})"
        )


@value
class PromptQuery:
    """The request being placed, as the model needs it."""

    hashes: tuple[int, ...]
    prompt_tokens: float
    tokens_per_block: float
    fp: Fingerprint | None = None
    data: bytes = field(default=b"", repr=False)
    """The bytes ``fp`` hashed, while the request is being placed (empty otherwise): where it
    parts from a state inside the state's trailing partial block is then found to the byte."""


@value
class Shared:
    """How much of a request a cached state holds, and where the match ends."""

    tokens: float
    key: int | None = None
    """The boundary the match ends at (``BoundaryTokens``), None when not a learnable one."""
    continues: bool = False
    """The request continues the whole state (a conversation's next turn)."""
    past_key: float = 0.0
    """Estimated tokens between ``key``'s boundary and where the match ends (a match running on
    inside a segment): what is learned for ``key`` is the measured count less this."""
    unshared: float | None = None
    """Estimated tokens of the state's text after the match (counted back from the state's
    measured end); None when the count was not taken that way."""
    exact: bool = False
    """Where the match ends was found to the byte (``_parting``): only such a match teaches the
    template's close of turn (``TokenCounter.closing``)."""


class BoundaryTokens:
    """Token counts of prompt prefixes that end at a known boundary, learned from the backend.

    A match between a request and a cached state ends at the last block, or segment, the two
    agree on; the hash there names the shared prefix exactly. The first time a request's match
    ends at a boundary, the backend's ``cached_tokens`` say how many tokens that prefix is; later
    requests ending their match there get that count instead of a byte estimate. Bounded, oldest
    out.
    """

    def __init__(self, *, max_entries: int = 4096) -> None:
        self._tokens: OrderedDict[int, float] = OrderedDict()
        self._max = max_entries

    def get(self, key: int | None) -> float | None:
        if key is None:
            return None
        value = self._tokens.get(key)
        if value is not None:
            self._tokens.move_to_end(key)
        return value

    def learn(self, key: int, tokens: float) -> None:
        self._tokens[key] = tokens
        self._tokens.move_to_end(key)
        while len(self._tokens) > self._max:
            self._tokens.popitem(last=False)

    def __len__(self) -> int:
        return len(self._tokens)


def _parting(sfp: Fingerprint, qfp: Fingerprint, data: bytes, blocks: int) -> int | None:
    """The byte offset where a request parts from a state, when that lies in the bytes the
    state's fingerprint keeps (``Fingerprint.tail``: its last ~1 KB) and the request's bytes
    are at hand; None otherwise. ``blocks``: the full blocks the two share."""
    tail = sfp.tail
    start = blocks * sfp.block_bytes
    tail_start = sfp.total_bytes - len(tail)
    if not tail or not data or start < tail_start or sfp.block_bytes != qfp.block_bytes:
        return None
    theirs = tail[start - tail_start :]
    ours = data[start : start + len(theirs)]
    lo, hi = 0, len(ours)
    if ours == theirs[:hi]:
        return start + hi
    while lo < hi:  # the longest common prefix of two short byte strings, by bisection
        mid = (lo + hi + 1) // 2
        if ours[:mid] == theirs[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return start + lo


def _common_segments(a: Fingerprint, b: Fingerprint) -> int:
    """Leading segments two fingerprints agree on (cumulative hashes chain like blocks)."""
    return common_blocks(a.segment_hashes, b.segment_hashes)


_NOTHING = Shared(0.0)


class _Scope:
    """``TokenCounter.scope``: a plain context manager (entered twice a placement, where a
    generator's costs a frame and an object more)."""

    __slots__ = ("counter", "outer", "query")

    def __init__(self, counter: TokenCounter, query: PromptQuery) -> None:
        self.counter = counter
        self.query = query
        self.outer: tuple[PromptQuery | None, dict[CachedPrompt, Shared]] | None = None

    def __enter__(self) -> None:
        counter = self.counter
        self.outer = outer = counter._scope, counter._memo
        if self.query is not outer[0]:  # the same query's scope again (nested): one memo
            counter._scope, counter._memo = self.query, {}

    def __exit__(self, *exc: object) -> None:
        assert self.outer is not None
        self.counter._scope, self.counter._memo = self.outer


@dataclass(slots=True)
class TokenCounter:
    """Turns a match between a cached state and a request into tokens (see the module text)."""

    boundaries: BoundaryTokens = field(default_factory=BoundaryTokens)
    answer_reuse: float = 1.0
    """Share of a state's generated tokens the next turn repeats verbatim (1: a chat sending the
    answer back; near 0: scripted histories). Learned from continuations."""
    closing: float | None = None
    """Tokens a prompt ends with after its last message's text (the chat template's end of turn
    and generation prompt: 5 in ChatML). Learned from matches counted back from a state's end."""
    _scope: PromptQuery | None = None
    _memo: dict[CachedPrompt, Shared] = field(default_factory=dict)
    """Within ``scope``: each state's match (by identity: ``CachedPrompt`` is ``eq=False``)."""

    def scope(self, query: PromptQuery) -> _Scope:
        """Within it, ``shared(state, query)`` is computed once per state: one placement asks
        it of the same states for every slot (the RAM cache's entries above all), and nothing
        the answer depends on changes meanwhile."""
        return _Scope(self, query)

    def shared(self, state: CachedPrompt, query: PromptQuery) -> Shared:
        """Tokens of ``query`` that ``state`` holds (before the one-token cap)."""
        if query is self._scope:
            known = self._memo.get(state)
            if known is None:
                known = self._memo[state] = self._shared(state, query)
            return known
        return self._shared(state, query)

    def _shared(self, state: CachedPrompt, query: PromptQuery) -> Shared:
        sfp, qfp = state.fp, query.fp
        if sfp is not None and qfp is not None and sfp.segment_hashes and qfp.segment_hashes:
            n = len(sfp.segment_hashes)
            if len(qfp.segment_hashes) > n and qfp.segment_hashes[n - 1] == sfp.segment_hashes[-1]:
                answer = self.answer_reuse * max(state.generated - 1.0, 0.0)
                return Shared(state.prompt_tokens + answer, continues=True)
            segs = _common_segments(sfp, qfp)
            if segs == len(qfp.segment_hashes):  # the request is all in the state
                return Shared(query.prompt_tokens)
            blocks = common_blocks(query.hashes, state.hashes)
            if not segs and not blocks:
                return _NOTHING  # what the rest computes when the two part in the first byte
            seg_end = qfp.segments[segs].start if segs else 0
            block_end = blocks * qfp.block_bytes
            density = query.prompt_tokens / max(qfp.total_bytes, 1)
            if state.measured and sfp.total_bytes:
                density = state.prompt_tokens / sfp.total_bytes
            # Compared to the byte only within one chain (same model and tenant salt: the model
            # segment agrees), so one tenant's bytes never predict another's.
            parts = _parting(sfp, qfp, query.data, blocks) if segs else None
            exact = parts is not None and parts > seg_end
            key: int | None
            if parts is not None and exact:  # found to the byte, inside a segment
                key = qfp.segment_hashes[segs - 1]
                boundary, shared_bytes = float(seg_end), float(parts)
            elif parts is None and block_end > seg_end + qfp.block_bytes:
                # The match runs on inside a segment and parts somewhere in the next block (or
                # the shorter one's tail): take its middle, which halves the expected error of
                # stopping at the block's start.
                key = query.hashes[blocks - 1]
                room = min(
                    qfp.block_bytes, qfp.total_bytes - block_end, sfp.total_bytes - block_end
                )
                boundary, shared_bytes = float(block_end), block_end + max(room, 0) / 2.0
            else:
                key = qfp.segment_hashes[segs - 1] if segs else None
                boundary = shared_bytes = float(max(seg_end, block_end))
            # Two ways to count what lies past the last boundary both share: forward from the
            # boundary's learned count, or back from the state's measured end (its text after
            # the match, then the template's close of turn). The one estimating fewer bytes is
            # taken.
            past = (shared_bytes - boundary) * density
            learned = self.boundaries.get(key)
            left = max(sfp.total_bytes - _END_LEN - shared_bytes, 0.0)
            back = state.measured and shared_bytes > seg_end and left < shared_bytes
            unshared = left * density if back else None
            if learned is not None and not (
                back and self.closing is not None and left < shared_bytes - boundary
            ):
                return Shared(learned + past, key, past_key=past, unshared=unshared, exact=exact)
            if unshared is not None and self.closing is not None:
                tokens = max(state.prompt_tokens - self.closing - unshared, 0.0)
                return Shared(tokens, key, past_key=past, unshared=unshared, exact=exact)
            return Shared(
                shared_bytes * density, key, past_key=past, unshared=unshared, exact=exact
            )
        blocks = common_blocks(query.hashes, state.hashes)
        if blocks and blocks == len(state.hashes) < len(query.hashes):
            answer = self.answer_reuse * max(state.generated - 1.0, 0.0)
            return Shared(state.prompt_tokens + answer, continues=True)
        key = query.hashes[blocks - 1] if blocks else None
        learned = self.boundaries.get(key)
        if learned is not None:
            return Shared(learned, key=key)
        return Shared(blocks * query.tokens_per_block, key=key)

    def lcp(self, state: CachedPrompt | None, query: PromptQuery) -> float:
        """The longest common prefix, in tokens, as the server's rules compare it (uncapped)."""
        if state is None:
            return 0.0
        return max(min(self.shared(state, query).tokens, state.tokens, query.prompt_tokens), 0.0)

    def cached(self, state: CachedPrompt | None, query: PromptQuery) -> float:
        """Tokens the server reuses for ``query`` from ``state`` (rule 8's cap included)."""
        return max(min(self.lcp(state, query), query.prompt_tokens - 1.0), 0.0)

    def learn(self, shared: Shared, state: CachedPrompt, measured: float, prompt: float) -> None:
        """Fold one measured ``cached_tokens`` in, for a request the model matched with ``state``.

        Only matches the backend did not cap (cached below ``prompt - 1``) say where they end.
        """
        if measured >= prompt - 1.0:
            return
        if shared.continues:
            extra = max(state.generated - 1.0, 0.0)
            if extra >= 1.0:
                seen = min(max((measured - state.prompt_tokens) / extra, 0.0), 1.0)
                self.answer_reuse += 0.3 * (seen - self.answer_reuse)
            return
        if shared.exact and shared.unshared is not None and state.measured and measured > 0:
            seen = min(max(state.prompt_tokens - measured - shared.unshared, 0.0), MAX_CLOSING)
            self.closing = (
                seen if self.closing is None else self.closing + 0.5 * (seen - self.closing)
            )
        if shared.key is not None and measured > 0:
            self.boundaries.learn(shared.key, max(measured - shared.past_key, 1.0))
