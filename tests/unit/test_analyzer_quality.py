"""``prefixgate quality``'s verdict: a rewrite is blamed only beyond the backend's own noise."""

from __future__ import annotations

from typing import Any

from analyzers.quality import Answer, Pair, canonical_forms, summarize, verdict


def answer(text: str) -> Answer:
    return Answer(text=text, prompt_tokens=10, cached_tokens=0, ttft_ms=5.0)


def pair(original: str, repeat: str | None, canonical: str, rewritten: bool = True) -> Pair:
    return Pair(
        original=answer(original),
        canonical=answer(canonical),
        rules=("stable_json",) if rewritten else (),
        repeat=None if repeat is None else answer(repeat),
    )


def test_a_changed_answer_the_backend_reproduces_is_blamed_on_the_rewrite() -> None:
    """Original reproduced, canonical differs: attributable, and the verdict says so."""
    pairs = [pair("4", "4", "four"), pair("yes", "yes", "yes")]
    report = summarize(pairs)
    assert report["attributable"] == 1
    assert report["verdict"].startswith("the rewrite changed answers: 1 of 2")
    assert report["noise"]["cold_vs_warm_agreement"] == 1.0


def test_a_difference_within_the_noise_is_not_blamed() -> None:
    """The backend disagreed with itself on the original: the canonical difference is noise."""
    pairs = [pair("4", "four", "4."), pair("yes", "yes", "yes")]
    report = summarize(pairs)
    assert report["attributable"] == 0
    assert report["verdict"].startswith("within the backend's noise")
    assert report["noise"]["cold_vs_warm_agreement"] == 0.5
    assert report["differing"][0]["reproducible"] is False


def test_nothing_rewritten_says_so() -> None:
    """No rule fired on any request: the verdict says the backend got the originals."""
    assert verdict([pair("a", "a", "a", rewritten=False)]).startswith("nothing rewritten")


def test_without_the_noise_floor_agreement_cannot_tell() -> None:
    """``--no-noise``: no repeats, so the verdict does not blame or clear the rewrite."""
    assert verdict([pair("a", None, "b")]).startswith("no noise floor")


def test_canonical_forms_learn_in_log_order() -> None:
    """The first request's tool order is the form; a later shuffle is rewritten to it."""

    def body(names: list[str]) -> dict[str, Any]:
        tools = [{"type": "function", "function": {"name": n}} for n in names]
        return {"model": "m", "messages": [{"role": "user", "content": "q"}], "tools": tools}

    first, second = body(["b", "a"]), body(["a", "b"])
    results = canonical_forms([first, second])
    assert results[0].body is first and results[0].fired == ()
    assert results[1].body["tools"] == first["tools"]
