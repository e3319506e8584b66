"""The control group's assignment: a stable hash of the conversation, the share honoured."""

from __future__ import annotations

import random
from typing import Any

import pytest

from proxy.backends import CHAT, COMPLETIONS, MESSAGES, RESPONSES
from proxy.config import ConfigError, resolve
from proxy.control import ControlGroup, conversation_key
from proxy.hosted import AffinityKey, hash_key


def agent_turn(task: str, turn: int, *, tools_seed: int = 0) -> dict[str, Any]:
    """Turn ``turn`` of an agent conversation: a clock and a session id in the system prompt,
    its tools reordered, its history grown by one exchange a turn."""
    tools = [{"type": "function", "function": {"name": n}} for n in ("read", "grep", "edit")]
    random.Random(tools_seed + turn).shuffle(tools)
    return {
        "model": "m",
        "tools": tools,
        "messages": [
            {
                "role": "system",
                "content": f"Time: 2026-12-02T01:{turn:02d}:{7 * turn % 60:02d}Z. "
                f"Session {random.Random(turn).getrandbits(64):016x}. You are an agent.",
            },
            {"role": "user", "content": task},
            *[{"role": "tool", "content": f"result {i}"} for i in range(turn)],
        ],
    }


def test_every_turn_of_a_conversation_has_one_key() -> None:
    """Clock, ids, tool order and history change from turn to turn; the key does not."""
    keys = {
        conversation_key(CHAT, agent_turn("Fix the export.", t, tools_seed=t)) for t in range(8)
    }
    assert len(keys) == 1


def test_conversations_that_open_differently_key_apart() -> None:
    """Another first message, another tenant, or other instructions: another key."""
    base = conversation_key(CHAT, agent_turn("Fix the export.", 0))
    assert conversation_key(CHAT, agent_turn("Fix the import.", 0)) != base
    assert conversation_key(CHAT, agent_turn("Fix the export.", 0), None, "t2") != base
    other = agent_turn("Fix the export.", 0)
    other["messages"][0]["content"] += " Be brief."
    assert conversation_key(CHAT, other) != base


def test_the_clients_own_conversation_key_wins() -> None:
    """With a prompt_cache_key (or session header), two openings of one thread share a key."""
    affinity = AffinityKey(hash_key("thread-1"), "prompt_cache_key")
    a = conversation_key(CHAT, agent_turn("Fix the export.", 0), affinity)
    b = conversation_key(CHAT, agent_turn("Something else.", 3), affinity)
    assert a == b != conversation_key(CHAT, agent_turn("Fix the export.", 0))


def test_the_key_is_stable_across_processes() -> None:
    """The key is a keyed blake2b of the opening: pinned, so no release reshuffles groups."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert conversation_key(CHAT, body) == conversation_key(CHAT, dict(body))
    assert f"{conversation_key(CHAT, body):016x}" == PINNED_KEY


PINNED_KEY = "30a28cb2944ba325"


@pytest.mark.parametrize("share", [0.01, 0.05, 0.25, 0.5, 0.9])
def test_the_share_of_conversations_is_honoured(share: float) -> None:
    """Over 20,000 conversations the control group holds ``share`` of them (within 4 sd)."""
    group = ControlGroup(share=share)
    n = 20_000
    hits = sum(
        group.is_control(conversation_key(CHAT, agent_turn(f"Task {i}.", 0))) for i in range(n)
    )
    sd = (share * (1 - share) / n) ** 0.5
    assert abs(hits / n - share) < 4 * sd


def test_share_zero_and_one() -> None:
    """0: nobody (off); 1: everybody."""
    keys = [conversation_key(CHAT, agent_turn(f"T{i}", 0)) for i in range(200)]
    assert not any(ControlGroup(share=0.0).is_control(k) for k in keys)
    assert all(ControlGroup(share=1.0).is_control(k) for k in keys)
    assert not ControlGroup().enabled


def test_a_larger_share_keeps_the_smaller_ones_members() -> None:
    """Raising the share only adds conversations to the control group (none changes sides)."""
    keys = [conversation_key(CHAT, agent_turn(f"T{i}", 0)) for i in range(2000)]
    small = {k for k in keys if ControlGroup(share=0.05).is_control(k)}
    large = {k for k in keys if ControlGroup(share=0.2).is_control(k)}
    assert small <= large


def test_other_apis_key_by_their_own_opening() -> None:
    """Responses (instructions + first input), Messages (system + first message), completions
    (the prompt's opening)."""
    r1 = {"model": "m", "instructions": "Be an agent.", "input": [{"role": "user", "content": "a"}]}
    r2 = {**r1, "input": [*r1["input"], {"role": "assistant", "content": "b"}]}
    assert conversation_key(RESPONSES, r1) == conversation_key(RESPONSES, r2)
    m1 = {
        "model": "m",
        "system": "At 10:01 you act.",
        "messages": [{"role": "user", "content": "x"}],
    }
    m2 = {**m1, "system": "At 10:02 you act."}
    assert conversation_key(MESSAGES, m1) == conversation_key(MESSAGES, m2)
    c1 = {"model": "m", "prompt": "Doc 1.\nQ: what?"}
    assert conversation_key(COMPLETIONS, c1) != conversation_key(COMPLETIONS, {"prompt": "x"})


@pytest.mark.parametrize("bad", ["-0.1", "1.5", "nan"])
def test_a_share_outside_zero_to_one_is_refused(bad: str) -> None:
    """--control-share accepts 0 to 1 only."""
    with pytest.raises(ConfigError, match="control"):
        resolve({"backend": ["http://x"], "control_share": bad}, environ={})


def test_the_option_is_declared_and_off_by_default() -> None:
    """``control_share`` resolves to the settings' ``control`` group, 0 by default."""
    assert resolve({"backend": ["http://x"]}, environ={}).control.share == 0.0
    on = resolve({"backend": ["http://x"]}, environ={"PREFIXGATE_CONTROL_SHARE": "0.05"})
    assert on.control.share == 0.05
