"""Prompt lookup: propose the tokens that followed the last time the sequence's latest
n tokens appeared, over its prompt and output so far (no model involved)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int] | np.ndarray, k: int, lookup_min: int,
                  lookup_max: int) -> list[int]:
    """Up to ``k`` tokens: for n from ``lookup_max`` down to ``lookup_min``, find the most
    recent earlier place where the last n tokens occur and return what followed them
    there (fewer than ``k`` when the sequence ends first). ``[]`` when no n matches."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        pattern = tokens[length - n:]
        # Starts i < length - n whose n tokens equal the pattern, latest first.
        starts = np.flatnonzero(tokens[:length - n] == pattern[0])
        for i in starts[::-1]:
            if np.array_equal(tokens[i:i + n], pattern):
                follow = tokens[i + n:i + n + k]
                if len(follow):
                    return follow.tolist()
    return []
