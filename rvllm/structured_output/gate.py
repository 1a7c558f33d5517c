"""A constraint that starts after a marker (``StructuredOutputsParams.starts_after``): a
reasoning model thinks freely, and its grammar applies from the token after its
``</think>``, as vLLM's structured output does under a reasoning parser.

``GatedMatcher`` wraps a grammar's matcher with the same calls. Until the output has
written the marker's token ids, every token is allowed and nothing reaches the grammar;
from the next token on, the grammar masks and takes each one. Rollback (speculative
decoding's rejected drafts) can take tokens back across the marker.
"""

from __future__ import annotations

from typing import Any

import torch


class GatedMatcher:
    """``inner`` (a backend's matcher) once the output has ended with ``marker``."""

    def __init__(self, inner: Any, marker: list[int]) -> None:
        self.inner = inner
        self.marker = list(marker)
        self._before: list[int] = []  # the tokens written before the grammar started
        self._open_at: int | None = None  # len(_before) when the marker was complete
        self._taken: list[bool] = []  # per accepted token: whether the grammar took it

    @property
    def started(self) -> bool:
        """Whether the grammar applies to the next token."""
        return self._open_at is not None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.started:
            self.inner.fill(bitmask, row)
        else:
            bitmask[row] = -1  # every bit set: any token

    def accept(self, token_id: int) -> bool:
        if self.started:
            if not self.inner.accept(token_id):
                return False
            self._taken.append(True)
            return True
        self._before.append(token_id)
        self._taken.append(False)
        if self._before[-len(self.marker):] == self.marker:
            self._open_at = len(self._before)
        return True

    def is_terminated(self) -> bool:
        return self.started and self.inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        taken = self._taken[len(self._taken) - num_tokens:]
        del self._taken[len(self._taken) - num_tokens:]
        inner = sum(taken)
        if inner:
            self.inner.rollback(inner)
        before = len(taken) - inner
        if before:
            del self._before[len(self._before) - before:]
            if self._open_at is not None and len(self._before) < self._open_at:
                self._open_at = None

    def error(self) -> str:
        return self.inner.error() if self.started else ""
