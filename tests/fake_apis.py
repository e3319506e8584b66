"""The Responses and Anthropic Messages wire formats, as the fake backends speak them.

Shapes follow llama-server (``server-task.cpp``: ``to_json_oaicompat_resp*``,
``to_json_anthropic*``; ``server-common.cpp``: ``format_oai_resp_sse``, ``format_anthropic_sse``)
and, for vLLM, the APIs' own documented shapes: every event is ``event: <type>`` then
``data: <json>``; no ``[DONE]``. ``*_to_chat`` turn a request into the chat messages a server's
template would see (llama-server's conversions, reduced to the text the fakes count as tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson


def api_event(name: str, data: Mapping[str, Any]) -> bytes:
    """One event of a Responses or Messages stream."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, Mapping):
                continue
            if isinstance(part.get("text"), str):
                out.append(part["text"])
            elif part.get("type") == "tool_use":
                out.append(f"{part.get('name')} {orjson.dumps(part.get('input')).decode()}")
            elif part.get("type") == "tool_result":
                out.append(_text_of(part.get("content")))
        return " ".join(out)
    return ""


def responses_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """``instructions`` as a system message, then each input item as a chat message."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, Mapping):
                continue
            if item.get("type") == "function_call":
                text = f"{item.get('name')} {item.get('arguments')}"
                messages.append({"role": "assistant", "content": text})
            elif item.get("type") == "function_call_output":
                messages.append({"role": "tool", "content": _text_of(item.get("output"))})
            elif "role" in item:
                messages.append({"role": item["role"], "content": _text_of(item.get("content"))})
    return {"messages": messages, "tools": body.get("tools")}


def anthropic_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """``system`` as a system message (text blocks joined), then each message's text."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        joined = (
            system
            if isinstance(system, str)
            else "".join(b.get("text", "") for b in system if isinstance(b, Mapping))
        )
        messages.append({"role": "system", "content": joined})
    for m in body.get("messages") or ():
        if isinstance(m, Mapping):
            messages.append({"role": m.get("role"), "content": _text_of(m.get("content"))})
    return {"messages": messages, "tools": body.get("tools")}


# -- Responses ---------------------------------------------------------------------------------


def responses_usage(prompt: int, cached: int | None, output: int) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "input_tokens": prompt,
        "output_tokens": output,
        "total_tokens": prompt + output,
    }
    if cached is not None:
        usage["input_tokens_details"] = {"cached_tokens": cached}
    return usage


def responses_output(reasoning: str, text: str) -> list[dict[str, Any]]:
    output: list[dict[str, Any]] = []
    if reasoning:
        output.append(
            {
                "id": "rs_fake",
                "summary": [],
                "type": "reasoning",
                "content": [{"text": reasoning, "type": "reasoning_text"}],
                "encrypted_content": "",
                "status": "completed",
            }
        )
    if text:
        output.append(
            {
                "content": [
                    {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
                ],
                "id": "msg_fake",
                "role": "assistant",
                "status": "completed",
                "type": "message",
            }
        )
    return output


def responses_answer(
    model: str, reasoning: str, text: str, usage: Mapping[str, Any], created: int
) -> dict[str, Any]:
    """A complete Responses answer (llama-server's ``to_json_oaicompat_resp``)."""
    return {
        "completed_at": created,
        "created_at": created,
        "id": "resp_fake",
        "model": model,
        "object": "response",
        "output": responses_output(reasoning, text),
        "status": "completed",
        "usage": dict(usage),
    }


def responses_stream(
    model: str,
    reasoning: list[str],
    tokens: list[str],
    usage: Mapping[str, Any],
    created: int,
    *,
    timings: Mapping[str, Any] | None,
) -> tuple[list[bytes], list[bytes]]:
    """(one write per token, the closing events): llama-server's partial and final events."""
    head = {"id": "resp_fake", "object": "response", "status": "in_progress"}
    writes: list[bytes] = []
    for i, t in enumerate(reasoning):
        out = b""
        if i == 0:
            out += api_event("response.created", {"type": "response.created", "response": head})
            out += api_event(
                "response.in_progress", {"type": "response.in_progress", "response": head}
            )
            item = {"id": "rs_fake", "summary": [], "type": "reasoning", "content": []}
            out += api_event(
                "response.output_item.added",
                {"type": "response.output_item.added", "item": {**item, "status": "in_progress"}},
            )
        out += api_event(
            "response.reasoning_text.delta",
            {"type": "response.reasoning_text.delta", "delta": t, "item_id": "rs_fake"},
        )
        writes.append(out)
    for i, t in enumerate(tokens):
        out = b""
        if i == 0:
            if not reasoning:
                out += api_event("response.created", {"type": "response.created", "response": head})
                out += api_event(
                    "response.in_progress", {"type": "response.in_progress", "response": head}
                )
            item = {"content": [], "id": "msg_fake", "role": "assistant", "type": "message"}
            out += api_event(
                "response.output_item.added",
                {"type": "response.output_item.added", "item": {**item, "status": "in_progress"}},
            )
            out += api_event(
                "response.content_part.added",
                {
                    "type": "response.content_part.added",
                    "item_id": "msg_fake",
                    "part": {"type": "output_text", "text": ""},
                },
            )
        out += api_event(
            "response.output_text.delta",
            {"type": "response.output_text.delta", "item_id": "msg_fake", "delta": t},
        )
        writes.append(out)
    text = "".join(tokens)
    output = responses_output("".join(reasoning), text)
    tail = [
        api_event(
            "response.output_text.done",
            {"type": "response.output_text.done", "item_id": "msg_fake", "text": text},
        ),
        api_event(
            "response.output_item.done", {"type": "response.output_item.done", "item": output[-1]}
        ),
    ]
    completed: dict[str, Any] = {
        "type": "response.completed",
        "response": {
            "id": "resp_fake",
            "object": "response",
            "created_at": created,
            "status": "completed",
            "model": model,
            "output": output,
            "usage": dict(usage),
        },
    }
    if timings is not None:
        completed["timings"] = dict(timings)
    tail.append(api_event("response.completed", completed))
    return writes, tail


# -- Anthropic Messages ------------------------------------------------------------------------


def messages_answer(
    model: str, thinking: str, text: str, usage: Mapping[str, Any]
) -> dict[str, Any]:
    """A complete Messages answer (llama-server's ``to_json_anthropic``)."""
    content: list[dict[str, Any]] = []
    if thinking:
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if text:
        content.append({"type": "text", "text": text})
    return {
        "id": "chatcmpl-fake",
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": dict(usage),
    }


def messages_stream(
    model: str,
    thinking: list[str],
    tokens: list[str],
    start_usage: Mapping[str, Any],
    final_usage: Mapping[str, Any],
    *,
    start_alone: bool = False,
) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """(what precedes the tokens, one write per token, the closing events): ``message_start``
    rides on the first token, as llama-server sends it, or (``start_alone``, vLLM) comes first
    on its own; ``message_delta`` carries ``final_usage``."""
    lead: list[bytes] = []
    writes: list[bytes] = []
    text_index = 1 if thinking else 0
    pieces = [("thinking", t) for t in thinking] + [("text", t) for t in tokens]
    for i, (kind, t) in enumerate(pieces):
        out = b""
        if i == 0:
            message = {
                "id": "chatcmpl-fake",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": model,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": dict(start_usage),
            }
            start = api_event("message_start", {"type": "message_start", "message": message})
            if start_alone:
                lead.append(start)
            else:
                out += start
        first_of_kind = (kind == "thinking" and i == 0) or (kind == "text" and i == len(thinking))
        index = 0 if kind == "thinking" else text_index
        if first_of_kind:
            block = {"type": kind, kind: ""}
            out += api_event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        delta = (
            {"type": "thinking_delta", "thinking": t}
            if kind == "thinking"
            else {"type": "text_delta", "text": t}
        )
        out += api_event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )
        writes.append(out)
    tail: list[bytes] = []
    if thinking:
        tail.append(
            api_event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "signature_delta", "signature": ""},
                },
            )
        )
        tail.append(api_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
    if tokens:
        tail.append(
            api_event("content_block_stop", {"type": "content_block_stop", "index": text_index})
        )
    tail.append(
        api_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": dict(final_usage),
            },
        )
    )
    tail.append(api_event("message_stop", {"type": "message_stop"}))
    return lead, writes, tail
