"""exp32, the vectorisable exponential the CPU kernels use, against numpy's in float64."""

import numba
import numpy as np

# rvllm.kernels is imported inside the tests: test_kernels.py must be first to import it
# (it sets TRITON_INTERPRET=1 before), and pytest imports every test module up front.


def exp_all(x: np.ndarray) -> np.ndarray:
    from rvllm.kernels.cpu_math import exp32

    @numba.njit(fastmath=True)
    def run(x, out):  # noqa: ANN001, ANN202
        for i in range(x.shape[0]):
            out[i] = exp32(x[i])

    out = np.empty_like(x)
    run(x, out)
    return out


def test_exp32_relative_error_over_float32_range():
    x = np.linspace(-87.0, 88.0, 400_001, dtype=np.float32)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(exp_all(x) - ref) / ref) < 5e-7


def test_exp32_clamps_instead_of_overflowing():
    out = exp_all(np.array([0.0, -200.0, -np.float32(3e38), 200.0], dtype=np.float32))
    assert out[0] == 1.0
    assert 0.0 <= out[1] < 1e-37 and 0.0 <= out[2] < 1e-37  # vanishing in a softmax
    assert np.isfinite(out[3]) and out[3] > 1e38
