"""Prompt lookup: propose the tokens that followed the last time the sequence's latest
n tokens appeared, over its prompt and output so far (no model involved). A match close
to the end, d tokens before the latest n, has fewer than k tokens after it before the
sequence ends: the proposal then goes on as if the sequence repeated every d tokens (a
loop, a list, a refrain), not stopping short."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int] | np.ndarray, k: int, lookup_min: int,
                  lookup_max: int) -> list[int]:
    """``k`` tokens: for n from ``lookup_max`` down to ``lookup_min``, find the most
    recent earlier place where the last n tokens occur and return what followed them
    there, continued with period d where the sequence ends first (d: how far before the
    last n tokens the match starts). ``[]`` when no n matches."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        pattern = tokens[length - n:]
        # Starts i < length - n whose n tokens equal the pattern, latest first.
        starts = np.flatnonzero(tokens[:length - n] == pattern[0])
        for i in starts[::-1]:
            if np.array_equal(tokens[i:i + n], pattern):
                follow = tokens[i + n:i + n + k].tolist()
                period = length - n - i
                while len(follow) < k:  # the sequence ended: it repeats every period
                    follow.append(follow[len(follow) - period])
                return follow
    return []
