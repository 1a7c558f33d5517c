"""Options given as a JSON object on the command line or as a dict in Python
(``--structured-outputs-config``, ``--speculative-config``), checked the same way."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def json_options(value: dict | str, name: str, known: Iterable[str]) -> dict[str, Any]:
    """``value`` (JSON text or a dict) as a dict whose keys are all in ``known``;
    ValueError names ``name`` and what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}.") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object.")
    known = set(known)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has no key {unknown[0]!r} (known: "
                         f"{', '.join(sorted(known))}).")
    return dict(value)


def read_json_file(path: Path, kind: type = dict, what: str = "a JSON object") -> Any:
    """A JSON file's value, which must be a ``kind``; ValueError names the file."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} could not be read: {e}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{path} is not {what}.")
    return value
