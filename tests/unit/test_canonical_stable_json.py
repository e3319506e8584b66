"""The stable_json rule: tool schemas, tool order and tool-call arguments in one JSON order."""

from __future__ import annotations

import copy
import random
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "data" / "canonical"))

import agent_requests  # the realistic request builder

from proxy.canonical.config import STABLE_JSON, CanonicalConfig, RuleConfig
from proxy.canonical.stable_json import canonical_arguments, stable_json

RULE = CanonicalConfig().rule(STABLE_JSON)


def rule(**options: bool) -> RuleConfig:
    return CanonicalConfig(rules={STABLE_JSON: RuleConfig(options=options)}).rule(STABLE_JSON)


def run(body: dict[str, Any], config: RuleConfig = RULE) -> dict[str, Any]:
    before = copy.deepcopy(body)
    out = stable_json("chat", body, config).body
    assert body == before and orjson.dumps(body) == orjson.dumps(before)  # never mutated
    return out


def test_shuffled_tool_lists_come_out_byte_identical() -> None:
    """The SDK's tool list, shuffled in order and in every key order, canonicalizes to one form."""
    outs = {orjson.dumps(run(agent_requests.request(seed=seed))["tools"]) for seed in range(12)}
    assert len(outs) == 1


def test_tools_sorted_by_name_and_keys_sorted_at_every_depth() -> None:
    """Tools come out ordered by function name, each object's keys sorted."""
    tools = run(agent_requests.request(seed=3))["tools"]
    names = [t["function"]["name"] for t in tools]
    assert names == sorted(names)
    search = next(t for t in tools if t["function"]["name"] == "search_code")
    params = search["function"]["parameters"]
    assert list(search) == ["function", "type"]
    assert list(search["function"]) == ["description", "name", "parameters"]
    assert list(params) == ["$defs", "properties", "required", "title", "type"]
    assert list(params["properties"]) == ["max_results", "pattern", "scope"]
    assert params["$defs"]["Scope"]["enum"] == ["code", "tests", "docs", "all"]  # arrays keep order
    assert params["required"] == ["pattern"]


def test_properties_keep_order_when_asked() -> None:
    """sort_tool_properties = false sorts keywords but keeps property names in order."""
    body = {"tools": [agent_requests.tools()[0]]}
    params = run(body, rule(sort_tool_properties=False))["tools"][0]["function"]["parameters"]
    assert list(params["properties"]) == ["path", "start_line", "end_line"]
    assert list(params["properties"]["start_line"]) == ["anyOf", "default", "description", "title"]
    assert next(iter(params)) == "additionalProperties"


def test_unknown_tool_fields_are_kept_as_they_are() -> None:
    """A cache_control marker or vendor field keeps its value object and its inner key order."""
    marker = {"type": "ephemeral", "ttl": "5m"}
    vendor = {"z": 1, "a": 2}
    tool = {
        "x-vendor": vendor,
        "function": {"parameters": {"type": "object"}, "name": "f"},
        "type": "function",
        "cache_control": marker,
    }
    out = run({"tools": [tool]})["tools"][0]
    assert out["cache_control"] is marker and list(marker) == ["type", "ttl"]
    assert out["x-vendor"] is vendor
    assert list(out) == ["cache_control", "function", "type", "x-vendor"]


def test_a_cache_marker_keeps_the_tool_order() -> None:
    """Moving a tool with a cache_control marker would move the breakpoint: order kept, skip."""
    tools = agent_requests.tools()
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    outcome = stable_json("chat", {"tools": tools}, RULE)
    names = [t["function"]["name"] for t in outcome.body["tools"]]
    assert names == [t["function"]["name"] for t in tools]
    assert [(s.rule, s.reason, s.path) for s in outcome.skipped] == [
        (STABLE_JSON, "cache_control_marker", "tools")
    ]


def test_tool_order_can_be_kept() -> None:
    """sort_tools = false leaves the order of the tools alone."""
    tools = agent_requests.tools()[::-1]
    out = run({"tools": tools}, rule(sort_tools=False))["tools"]
    assert [t["function"]["name"] for t in out] == [t["function"]["name"] for t in tools]


def test_tools_with_the_same_name_keep_their_order() -> None:
    """The sort is stable: tools with equal names (or none) stay in the order they came."""
    a = {"function": {"description": "one", "name": "f"}, "type": "function"}
    b = {"function": {"description": "two", "name": "f"}, "type": "function"}
    c = {"function": {"name": "e"}, "type": "function"}
    assert run({"tools": [a, c, b]})["tools"] == [c, a, b]
    assert run({"tools": [b, c, a]})["tools"] == [c, b, a]


def test_legacy_functions_are_canonical_too() -> None:
    """The legacy functions list gets the same treatment as tools."""
    functions = [t["function"] for t in agent_requests.tools()]
    random.Random(1).shuffle(functions)
    out = run({"functions": functions})["functions"]
    assert [f["name"] for f in out] == sorted(f["name"] for f in functions)
    assert all(list(f) == sorted(f) for f in out)


def test_response_format_schema_keeps_property_order_by_default() -> None:
    """Keywords are sorted; the properties keep their order (it is the order of the output)."""
    schema = {
        "type": "object",
        "required": ["reasoning", "answer"],
        "properties": {
            "reasoning": {"type": "string", "description": "think first"},
            "answer": {"type": "string"},
        },
        "additionalProperties": False,
    }
    body = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    }
    out = run(body)["response_format"]["json_schema"]["schema"]
    assert list(out) == ["additionalProperties", "properties", "required", "type"]
    assert list(out["properties"]) == ["reasoning", "answer"]
    assert list(out["properties"]["reasoning"]) == ["description", "type"]
    sorted_out = run(body, rule(sort_response_properties=True))
    assert list(sorted_out["response_format"]["json_schema"]["schema"]["properties"]) == [
        "answer",
        "reasoning",
    ]


def test_llamacpp_response_format_schema() -> None:
    """llama.cpp's response_format.schema spelling is handled as well."""
    body = {"response_format": {"type": "json_object", "schema": {"type": "object", "$id": "x"}}}
    assert list(run(body)["response_format"]["schema"]) == ["$id", "type"]


def test_tool_call_arguments_are_canonical() -> None:
    """Arguments a model wrote with spaces and its own key order become compact, keys sorted."""
    body = agent_requests.request(seed=5)
    out = run(body)
    calls = [c for m in out["messages"] for c in m.get("tool_calls") or ()]
    assert calls[0]["function"]["arguments"] == '{"pattern":"def import_csv","scope":"code"}'
    assert calls[3]["function"]["arguments"] == (
        '{"command":"pytest tests/unit/test_csv_reader.py -q","timeout_s":120}'
    )
    assert all(a is b for a, b in zip(out["messages"][:1], body["messages"][:1], strict=True))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"b": 1, "a": [3, 1]}', '{"a":[3,1],"b":1}'),
        ('{"n": 123456789012345678901234567890}', '{"n":123456789012345678901234567890}'),
        ('{"s": "caf\\u00e9 \\"q\\""}', '{"s":"café \\"q\\""}'),
        ('{"x": 1.50, "y": -0}', '{"x":1.5,"y":0}'),
        ("[]", "[]"),
        ("not json", None),
        ('{"a": 1, "a": 2}', None),
        ('{"a": 1e400}', None),
        ('{"a": NaN}', None),
        ('{"a": "\\ud800"}', None),
        ('{"a": 1', None),
    ],
)
def test_arguments_are_rewritten_only_when_lossless(text: str, expected: str | None) -> None:
    """Valid JSON becomes sorted compact JSON; anything that would not survive is kept."""
    assert canonical_arguments(text) == expected


def test_arguments_that_cannot_be_rewritten_are_kept_and_reported() -> None:
    """A duplicate key keeps the original string and reports a skip; plain text is not a skip."""
    body = {
        "messages": [
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a":1,"a":2}'},
                    },
                    {
                        "id": "2",
                        "type": "function",
                        "function": {"name": "f", "arguments": "ls -la"},
                    },
                ],
            }
        ]
    }
    outcome = stable_json("chat", body, RULE)
    assert outcome.body is body
    assert [s.reason for s in outcome.skipped] == ["arguments_not_lossless"]
    assert outcome.skipped[0].path == "messages[0].tool_calls[0].function.arguments"


def test_object_arguments_and_legacy_function_call() -> None:
    """Arguments sent as an object are key-sorted; the legacy function_call is handled too."""
    body = {
        "messages": [
            {
                "role": "assistant",
                "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": 2}}}
                ],
            },
            {"role": "assistant", "function_call": {"name": "g", "arguments": '{"y": 1, "x": 2}'}},
            {"role": "user", "content": '{"b": 1, "a": 2}'},
        ]
    }
    out = run(body)
    assert list(out["messages"][0]["tool_calls"][0]["function"]["arguments"]) == ["a", "b"]
    assert out["messages"][1]["function_call"]["arguments"] == '{"x":2,"y":1}'
    assert out["messages"][2] is body["messages"][2]


def test_arguments_can_be_left_alone() -> None:
    """tool_call_arguments = false leaves every message as it is."""
    body = agent_requests.request(seed=5)
    assert run(body, rule(tool_call_arguments=False))["messages"] is body["messages"]


def test_other_fields_and_other_routes_are_untouched() -> None:
    """tool_choice, sampling fields and unknown fields keep their objects; completions pass."""
    body = agent_requests.request(seed=2)
    body["tool_choice"] = {"function": {"name": "read_file"}, "type": "function"}
    body["x_extra"] = {"b": 1, "a": 2}
    out = run(body)
    for key in ("tool_choice", "x_extra", "stream_options"):
        assert out[key] is body[key]
    assert stable_json("completion", body, RULE).body is body


def test_already_canonical_requests_are_returned_as_they_are() -> None:
    """A canonical request gives back the same object and reports nothing."""
    once = run(agent_requests.request(seed=9))
    outcome = stable_json("chat", once, RULE)
    assert outcome.body is once and not outcome.changes


def test_changes_are_small_and_hold_no_prompt_text() -> None:
    """Changes name paths and kinds, one per list, never text."""
    outcome = stable_json("chat", agent_requests.request(seed=4), RULE)
    assert [(c.path, c.kind) for c in outcome.changes] == [
        ("tools", "sort_keys"),
        ("tools", "reorder"),
        ("messages[*].tool_calls[*].function.arguments", "sort_keys"),
    ]
    assert outcome.changes[0].count == 6 and 1 <= outcome.changes[2].count <= 4


def test_wrong_types_are_skipped() -> None:
    """Tools, schemas and calls of unexpected types are passed over, never an error."""
    body: dict[str, Any] = {
        "tools": [
            None,
            3,
            "x",
            {"function": "no"},
            {"type": "function", "function": {"parameters": 7}},
        ],
        "functions": {"not": "a list"},
        "response_format": {"json_schema": {"schema": [1, {"b": 1, "a": 2}]}},
        "messages": [
            {"role": "assistant", "tool_calls": [None, {"function": None}, {"function": {}}]},
            "text",
            None,
            {"role": "assistant", "tool_calls": "no"},
        ],
    }
    run(body)
