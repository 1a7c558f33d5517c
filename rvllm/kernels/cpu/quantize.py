"""Per-row symmetric int8 quantization of a float32 weight, compiled with numba.

``--quantization int8`` quantizes every linear weight at start-up. In torch that is five
passes over the weight (abs, max, divide, round, clamp) and a cast, each allocating its
result: up to half a second of a SmolLM2 start. Here each row is read twice (its largest
magnitude, then the rounded quotients) on numba's threads, in the same float32 operations
in the same order as the torch reference (``layers.cpu_linear.quantize_int8``; no
``fastmath``), so the result is bit-identical to it (``tests/test_cpu_linear.py``).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the kernels' cache


@numba.njit(parallel=True, cache=True)
def _quantize_rows(w, q, scale):
    for r in prange(w.shape[0]):
        top = np.float32(0.0)
        for i in range(w.shape[1]):
            top = max(top, abs(w[r, i]))
        s = max(top / np.float32(127.0), np.float32(1e-10))
        scale[r] = s
        for i in range(w.shape[1]):
            # rint rounds half to even, as torch.round does.
            q[r, i] = np.int8(min(max(np.rint(w[r, i] / s), np.float32(-127.0)),
                                  np.float32(127.0)))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int8, scale [N] float32) of a float32 CPU weight [N, K], as
    ``layers.cpu_linear.quantize_int8``."""
    w = weight.detach().contiguous()
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=torch.float32)
    _quantize_rows(w.numpy(), q.numpy(), scale.numpy())
    return q, scale


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel."""
    quantize_int8(torch.zeros(1, 4))
