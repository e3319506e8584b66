"""The JSON Schema of a request record, generated from ``RequestRecord``.

The published copy is ``docs/schemas/record-v1.schema.json``; ``python -m proxy.record_schema
--write`` regenerates it after a field is added (a test fails while the copy is stale, and
another validates the records of the server tests against it). Fields present in every record
are required; fields written only for the requests they apply to are optional and never null;
no other key is allowed, apart from the three the log line adds (``event``, ``level``,
``logged_at``).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import orjson

from proxy.records import DERIVED, DOC, ONLY_WHEN_SET, RECORD_EVENT, SCHEMA, RequestRecord

SCHEMA_ID = "urn:prefixgate:schema:record:v1"
SCHEMA_FILE = "record-v1.schema.json"
LOG_LINE_KEYS: dict[str, dict[str, Any]] = {
    "event": {"const": RECORD_EVENT, "description": "The log event: always ``request``."},
    "level": {"type": "string", "description": "The log level (``info``)."},
    "logged_at": {"type": "string", "description": "When the line was written (ISO 8601, UTC)."},
}
DESCRIPTION = (
    "One request record: the JSON object prefixgate writes to its log (event 'request') for "
    "every inference request once it has ended, and that the analyzer reads. Generated from "
    "proxy.records.RequestRecord. Keys present in every record are required (null where a "
    "value is unknown, never zero); keys written only for the requests they apply to are "
    "optional and never null. Within v1 keys may be added (readers should ignore keys they do "
    "not know); removing, renaming or retyping a key makes a new version. Latencies are "
    "milliseconds; rates are fractions from 0 to 1."
)


def _type_schema(tp: Any) -> dict[str, Any]:
    """The JSON Schema of one field type (the types records use)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) != 1:
            raise TypeError(f"unsupported union {tp!r}")
        inner = _type_schema(members[0])
        if len(members) < len(args):  # Optional: null allowed
            if "enum" in inner:
                return {**inner, "enum": [*inner["enum"], None]}
            return {**inner, "type": [inner["type"], "null"]}
        return inner
    if origin is Literal:
        return {"type": "string", "enum": list(args)}
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0])}
    if origin is dict:
        values = _type_schema(args[1])
        return {"type": "object", "additionalProperties": values} if values else {"type": "object"}
    if tp is Any:
        return {}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if tp in simple:
        return {"type": simple[tp]}
    raise TypeError(f"no JSON Schema for field type {tp!r}")


def record_schema() -> dict[str, Any]:
    """The record's JSON Schema (draft 2020-12), from the dataclass's fields and their docs."""
    hints = typing.get_type_hints(RequestRecord)
    properties: dict[str, dict[str, Any]] = {}
    required: list[str] = []
    optional: list[tuple[str, dict[str, Any]]] = []
    for f in dataclasses.fields(RequestRecord):
        when_set = bool(f.metadata.get(ONLY_WHEN_SET))
        if SCHEMA in f.metadata:
            prop = dict(f.metadata[SCHEMA])
        else:
            tp = hints[f.name]
            if when_set:  # absent rather than null
                tp = typing.Union[tuple(a for a in typing.get_args(tp) if a is not type(None))]  # noqa: UP007 -- built from a tuple of types
            prop = _type_schema(tp)
        prop["description"] = f.metadata[DOC]
        if when_set:
            optional.append((f.name, prop))
        else:
            properties[f.name] = prop
            required.append(f.name)
    for name, doc in DERIVED.items():
        properties[name] = {
            "type": ["number", "null"],
            "minimum": 0,
            "maximum": 1,
            "description": doc,
        }
        required.append(name)
    properties.update(optional)
    properties.update(LOG_LINE_KEYS)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "prefixgate.record/v1",
        "description": DESCRIPTION,
        "type": "object",
        "additionalProperties": False,
        "required": required,
        "properties": properties,
    }


def render() -> bytes:
    """The schema as the published file's bytes (two-space indent, trailing newline)."""
    return orjson.dumps(record_schema(), option=orjson.OPT_INDENT_2) + b"\n"


def main(argv: list[str] | None = None) -> int:
    """Print the schema, or with ``--write DIR`` write it as ``DIR/record-v1.schema.json``."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--write"]:
        folder = Path(args[1]) if len(args) > 1 else Path("docs/schemas")
        (folder / SCHEMA_FILE).write_bytes(render())
        print(folder / SCHEMA_FILE)
        return 0
    sys.stdout.write(render().decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
