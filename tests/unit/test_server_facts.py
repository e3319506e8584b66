"""Server facts live in ``proxy/backends/`` only; the rest asks a dialect's capabilities."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.backends import DIALECTS, Capabilities, capabilities_markdown, dialect_named

PROXY = Path(__file__).resolve().parents[2] / "proxy"
SERVER_NAME = re.compile(r"llama|vllm", re.IGNORECASE)


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """Ids of the string constants that are docstrings (module, class, function, attribute)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:
            if (
                isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                out.add(id(stmt.value))
    return out


def _code_mentions(path: Path) -> list[str]:
    """Where a module's code (not its comments, docstrings or prose) names a server.

    A name, an attribute, an import or a string without whitespace (a dialect name, a path, a
    metric) is code; a string with whitespace is prose shown to a person (help, a log message).
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = _docstring_nodes(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        text: str | None = None
        if isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.alias):
            text = node.name
        elif isinstance(node, ast.ImportFrom):
            text = node.module
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and not re.search(r"\s", node.value)
        ):
            text = node.value
        if text and SERVER_NAME.search(text):
            found.append(f"{path.relative_to(PROXY.parent)}:{getattr(node, 'lineno', '?')}: {text}")
    return found


def test_no_server_named_outside_backends() -> None:
    """Outside proxy/backends/ no code names a server: only comments and prose may."""
    modules = [p for p in PROXY.rglob("*.py") if "backends" not in p.relative_to(PROXY).parts]
    assert modules
    mentions = [m for p in sorted(modules) for m in _code_mentions(p)]
    assert mentions == []


def test_config_does_not_import_the_fleet() -> None:
    """Settings and scheduling load without the fleet: no import runs back up the house."""
    code = "import sys, proxy.config, proxy.scheduling; print('proxy.fleet' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", list(DIALECTS))
def test_every_dialect_states_its_capabilities(name: str) -> None:
    """Each dialect carries a Capabilities value: a health path and a consistent slot story."""
    caps = dialect_named(name).capabilities
    assert isinstance(caps, Capabilities)
    assert caps.health_path.startswith("/")
    assert caps.sleep_state_path is None or caps.sleep_state_path.startswith("/")
    # A server with slots keeps a cache per slot, so its prefix cache is not shared.
    assert not (caps.slots is not None and caps.shared_prefix_cache)


def test_slot_api_pins_and_reads_the_slot_field() -> None:
    """The slot API sets the pinning field, and reads the client's and the server's slot."""
    api = dialect_named("llamacpp").capabilities.slots
    assert api is not None
    body: dict[str, object] = {}
    api.pin(body, 3)
    assert api.client_slot(body) == 3
    assert api.reported_slot(body) == 3
    assert api.client_slot({api.field: -1}) is None
    assert api.client_slot({api.field: True}) is None
    assert dialect_named("vllm").capabilities.slots is None


def test_docs_backends_is_up_to_date() -> None:
    """docs/backends.md is generated from the dialects; run `make docs` after a change."""
    path = PROXY.parent / "docs" / "backends.md"
    assert path.read_text() == capabilities_markdown(), "docs/backends.md is stale"
