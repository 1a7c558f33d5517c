"""exp32, the vectorisable exponential the CPU kernels use, against numpy's in float64."""

import numba
import numpy as np

from rvllm.kernels.cpu_math import exp32


@numba.njit(fastmath=True)
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = exp32(x[i])


def test_exp32_relative_error_over_float32_range():
    x = np.linspace(-87.0, 88.0, 400_001, dtype=np.float32)
    out = np.empty_like(x)
    _exp_all(x, out)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - ref) / ref) < 5e-7


def test_exp32_clamps_instead_of_overflowing():
    x = np.array([0.0, -200.0, -np.float32(3e38), 200.0], dtype=np.float32)
    out = np.empty_like(x)
    _exp_all(x, out)
    assert out[0] == 1.0
    assert 0.0 <= out[1] < 1e-37 and 0.0 <= out[2] < 1e-37  # vanishing in a softmax
    assert np.isfinite(out[3]) and out[3] > 1e38
