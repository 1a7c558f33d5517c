"""Options given as a JSON object on the command line or as a dict in Python
(``--structured-outputs-config``, ``--speculative-config``), checked the same way."""

from __future__ import annotations

import json
from collections.abc import Iterable
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
