"""The numba kernels' shared pieces: exp32, the vectorisable exponential, against numpy's in
float64; fetch_rows; and the kernels' cache stamp (``kernels.numba_cache``)."""

import importlib
import platform

import numba
import numpy as np
import pytest

# rvllm.kernels is imported inside the tests: test_kernels.py must be first to import it
# (it sets TRITON_INTERPRET=1 before), and pytest imports every test module up front.


def exp_all(x: np.ndarray) -> np.ndarray:
    from rvllm.kernels.cpu.numerics import exp32

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


def test_fetch_rows_is_only_a_hint():
    from rvllm.kernels.cpu.numerics import fetch_rows

    @numba.njit
    def fetch_all(x):  # noqa: ANN001, ANN202
        for i in range(x.shape[0]):
            fetch_rows(x, i)
        return x.sum()

    x = np.arange(3 * 5 * 7, dtype=np.float32).reshape(3, 5, 7)
    assert fetch_all(x) == x.sum()
    assert np.array_equal(x, np.arange(x.size, dtype=np.float32).reshape(x.shape))
    if platform.machine() in ("x86_64", "AMD64"):  # the hint is in the machine code
        assert "prefetch" in next(iter(fetch_all.inspect_asm().values()))


@pytest.mark.parametrize("module", ["batch_step", "decode_attention", "decoder_step",
                                    "dequant", "gemv", "greedy", "numerics", "quantize",
                                    "vectors"])
def test_every_cached_kernel_is_checked_against_all_kernel_sources(module):
    """A kernel inlining another module's function must be recompiled when that module
    changes: numba's own check looks at the kernel's file alone."""
    from rvllm.kernels.cpu import numba_cache

    mod = importlib.import_module(f"rvllm.kernels.cpu.{module}")
    cached = [f for f in vars(mod).values()
              if isinstance(f, numba.core.registry.CPUDispatcher) and f._cache._enabled
              and f.py_func.__module__ == mod.__name__]
    assert cached, module
    for f in cached:
        assert f._cache._impl.locator.get_source_stamp() == numba_cache._sources_digest()


def test_functions_outside_the_kernels_keep_numbas_own_stamp():
    from rvllm.kernels.cpu import numba_cache  # noqa: F401 - installs the kernels' locators

    @numba.njit(cache=True)
    def elsewhere(x):  # noqa: ANN001, ANN202
        return x + 1

    locator = elsewhere._cache._impl.locator
    assert "Kernels" not in type(locator).__name__


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 31, 64])
def test_row_max_is_numpys_max(n):
    from rvllm.kernels.cpu.numerics import row_max

    row = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    assert row_max(row) == (row.max() if n else -np.inf)
