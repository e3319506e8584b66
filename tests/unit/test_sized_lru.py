"""``SizedLRU``: bounded by entries and by bytes, least recently put out first."""

from __future__ import annotations

from proxy.sized_lru import SizedLRU


def _lru(entries: int = 10, max_bytes: int = 100) -> SizedLRU[str, bytes]:
    return SizedLRU(entries=entries, max_bytes=max_bytes, size=lambda k, v: len(k) + len(v))


def test_bytes_bound_drops_the_least_recently_put() -> None:
    """Past the byte bound the oldest go; a touched entry counts as recent."""
    lru = _lru(max_bytes=25)
    lru.put("a", b"x" * 9)
    lru.put("b", b"x" * 9)
    assert lru.get("a", touch=True) == b"x" * 9
    lru.put("c", b"x" * 9)
    assert "b" not in lru and "a" in lru and "c" in lru and lru.bytes == 20


def test_entry_bound_and_replacing_a_key_counts_it_once() -> None:
    """Replacing a key weighs only its new value; past the entry bound the oldest goes."""
    lru = _lru(entries=2)
    lru.put("a", b"1")
    lru.put("a", b"22")
    assert lru.bytes == 3 and len(lru) == 1
    lru.put("b", b"3")
    lru.put("c", b"4")
    assert "a" not in lru and lru.bytes == 4


def test_an_entry_heavier_than_the_bound_is_not_held() -> None:
    """Too heavy: not held, and the value it would replace is gone too."""
    lru = _lru(max_bytes=10)
    lru.put("a", b"1")
    lru.put("a", b"x" * 20)
    assert "a" not in lru and lru.bytes == 0
    assert lru.pop("missing") is None
    lru.put("b", b"2")
    lru.clear()
    assert len(lru) == 0 and lru.bytes == 0
