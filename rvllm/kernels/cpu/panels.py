"""``Panels``: what a linear layer keeps for the CPU's GEMV and GEMMs (``gemv``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def packed_cols(weight: np.ndarray) -> int:
    """K of a packed weight (``packed``), from its first panel's header: format, K, ..."""
    return int(weight.reshape(weight.shape[0], -1)[0, 8:16].view(np.int64)[0])


@dataclass(frozen=True, slots=True)
class Panels:
    """What a linear layer keeps for ``gemv``: its weight [N, K] as panels [ceil(N / 16),
    K, 16] (float32, or int8 with its float32 scales, padded with zeros to the panels'
    16 ceil(N / 16) rows; empty: none), made once so a call converts only x; or GGUF's
    blocks packed (uint8 [ceil(N / 16), panel bytes / 16, 16], ``packed``)."""

    weight: np.ndarray
    scale: np.ndarray
    rows: int  # N

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    @property
    def cols(self) -> int:
        """K: the weight's columns (a packed weight's, from its header)."""
        return packed_cols(self.weight) if self.weight.dtype == np.uint8 else self.weight.shape[1]
