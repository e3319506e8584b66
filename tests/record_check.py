"""The ``prefixgate.record/v1`` JSON Schema (docs/schemas/record-v1.schema.json) for the tests.

Every record a proxy built by the ``make_proxy`` fixture writes is checked against it
(``RecordLog``), so a record field whose value leaves the published schema fails the server test
that produced it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import orjson

from proxy.records import RequestRecord

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "docs" / "schemas" / "record-v1.schema.json"


@functools.cache
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def as_logged(record: RequestRecord) -> Any:
    """The record's JSON object as the log line carries it (serialized and read back)."""
    return orjson.loads(orjson.dumps(record.as_dict(), option=orjson.OPT_NON_STR_KEYS, default=str))


def violations(obj: Any) -> list[str]:
    """Every way ``obj`` breaks the record schema, as ``path: message``."""
    errors = sorted(validator().iter_errors(obj), key=lambda e: list(e.absolute_path))
    return [f"{e.json_path}: {e.message}" for e in errors]
