"""``Panels``: what a linear layer keeps for the CPU's GEMV and GEMMs (``gemv``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def packed_cols(weight: np.ndarray) -> int:
    """K of a packed weight (``packed``), from its first panel's header: format, K, ..."""
    return int(weight.reshape(weight.shape[0], -1)[0, 8:16].view(np.int64)[0])


def panel_offset(runs: list[tuple[int, int]], p: int) -> int:
    """Where panel p of a packed weight begins, in bytes from its first, given its three
    runs of panels of one length each (first panel, panel bytes), as
    ``packed.panel_address`` finds it."""
    (_, s0), (q1, s1), (q2, s2) = runs
    return p * s0 + max(p - q1, 0) * (s1 - s0) + max(p - q2, 0) * (s2 - s1)


def panel_runs(weight: np.ndarray) -> list[tuple[int, int]]:
    """A packed weight's three runs of panels (first panel, panel bytes), from its first
    panel's header."""
    head = weight.reshape(weight.shape[0], -1)[0, :64].view(np.int64).tolist()
    return [(0, head[2] * 16), (head[3], head[4] * 16), (head[5], head[6] * 16)]


def packed_bytes(weight: np.ndarray) -> int:
    """The bytes a packed weight's panels take (beyond its array's shape where their
    lengths differ)."""
    return panel_offset(panel_runs(weight), weight.shape[0])


@dataclass(frozen=True, slots=True)
class Panels:
    """What a linear layer keeps for ``gemv``: its weight [N, K] as panels [ceil(N / 16),
    K, 16] (float32, or int8 with its float32 scales, padded with zeros to the panels'
    16 ceil(N / 16) rows; empty: none), made once so a call converts only x; or GGUF's
    blocks packed (uint8 [ceil(N / 16), the shortest panel's bytes / 16, 16], its
    longer panels further on in the same memory; ``packed``)."""

    weight: np.ndarray
    scale: np.ndarray
    rows: int  # N

    @property
    def nbytes(self) -> int:
        if self.weight.dtype == np.uint8:  # packed: panels may differ in length
            return packed_bytes(self.weight)
        return self.weight.nbytes + self.scale.nbytes

    @property
    def cols(self) -> int:
        """K: the weight's columns (a packed weight's, from its header)."""
        return packed_cols(self.weight) if self.weight.dtype == np.uint8 else self.weight.shape[1]
