"""The ``prefixgate.stats/v1`` JSON Schema (docs/schemas/stats-v1.schema.json) for the admin tests.

``assert_valid(body)`` fails with every violation listed (path and message), so a key added to or
dropped from ``/stats`` without a schema change fails the test that produced it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "docs" / "schemas" / "stats-v1.schema.json"


@functools.cache
def schema() -> dict[str, Any]:
    data = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


@functools.cache
def validator() -> jsonschema.Draft202012Validator:
    jsonschema.Draft202012Validator.check_schema(schema())
    return jsonschema.Draft202012Validator(schema())


def violations(body: Any) -> list[str]:
    """Every way ``body`` breaks the schema, as ``path: message``."""
    errors = sorted(validator().iter_errors(body), key=lambda e: list(e.absolute_path))
    return [f"{e.json_path}: {e.message}" for e in errors]


def assert_valid(body: Any) -> None:
    problems = violations(body)
    assert not problems, "/stats does not match docs/schemas/stats-v1.schema.json:\n" + "\n".join(
        problems[:20]
    )


def object_schemas(node: Any, path: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every subschema that declares ``properties``, with its JSON pointer."""
    if isinstance(node, dict):
        if "properties" in node:
            yield path, node
        for key, value in node.items():
            yield from object_schemas(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from object_schemas(value, f"{path}/{i}")
