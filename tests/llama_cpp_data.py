"""Where the tests find llama.cpp's files: its real models' vocabularies and its HF -> GGUF
converter, fetched by ``scripts/fetch_test_data.py`` (``scripts/setup.sh test`` runs it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fetch_test_data.py"
FETCH_COMMAND = f"python {_SCRIPT.relative_to(_SCRIPT.parent.parent)}"


def _fetch_module():  # noqa: ANN202 - the script as a module
    spec = importlib.util.spec_from_file_location("fetch_test_data", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fetch_test_data", module)
    spec.loader.exec_module(module)
    return module


def llama_cpp_dir() -> Path | None:
    """The fetched llama.cpp folder (``models/``, ``convert_hf_to_gguf.py`` with
    ``conversion/`` and ``gguf-py/``), or None when it has not been fetched."""
    fetch = _fetch_module()
    root = fetch.default_dest() / f"llama.cpp-{fetch.VERSION}"
    done = root / ".complete"
    return root if done.is_file() and done.read_text() == fetch.STAMP else None


def require_llama_cpp_dir() -> Path:
    """The fetched llama.cpp folder, or an explicit skip that says how to fetch it."""
    root = llama_cpp_dir()
    if root is None:
        pytest.skip(f"llama.cpp's test data is not fetched: run `{FETCH_COMMAND}` "
                    "(scripts/setup.sh test does)")
    return root
