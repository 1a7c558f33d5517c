"""vectors' run_scores and run_values against numpy in float64, over every run length
from 1 to 16, for float32 and bfloat16 rows, and what they must not touch."""

from functools import cache

import numba
import numpy as np
import pytest
import torch

# rvllm.kernels is imported inside the tests: test_kernels.py must be first to import it
# (it sets TRITON_INTERPRET=1 before), and pytest imports every test module up front.

GROUP, KV_HEADS, DIM, TOKENS = 3, 2, 48, 16


def cache_rows(dtype: str, gen: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A block of rows [TOKENS, KV_HEADS, DIM] as the kernels read it, and as float64."""
    rows = torch.from_numpy(gen.standard_normal((TOKENS, KV_HEADS, DIM)).astype(np.float32))
    if dtype == "bfloat16":
        rows = rows.to(torch.bfloat16)
        return rows.view(torch.uint16).numpy(), rows.double().numpy()
    return rows.numpy(), rows.double().numpy()


@cache
def _callers() -> tuple:
    """Compiled callers of run_scores and run_values, made once (a caller made per call
    would be compiled again each time: 32 compiles a test)."""
    from rvllm.kernels.cpu.vectors import run_scores, run_values

    @numba.njit
    def scores(q, keys, n, out, ahead):  # noqa: ANN001, ANN202
        partials = np.zeros((q.shape[0], 16, 16), np.float32)
        run_scores(q.ctypes.data, keys.ctypes.data, n, q.shape[1], q.shape[0] // keys.shape[1],
                   keys.shape[1], partials.ctypes.data, out.ctypes.data, out.shape[1],
                   ahead.ctypes.data if ahead.size else 0, keys)

    @numba.njit
    def values_(p, values, n, acc, ahead):  # noqa: ANN001, ANN202
        run_values(p.ctypes.data, p.shape[1], values.ctypes.data, n, acc.shape[1],
                   acc.shape[0] // values.shape[1], values.shape[1], acc.ctypes.data,
                   ahead.ctypes.data if ahead.size else 0, values)

    return scores, values_


def run_scores(q, keys, n, out, ahead):  # noqa: ANN001, ANN201
    _callers()[0](q, keys, n, out, ahead)


def run_values(p, values, n, acc, ahead):  # noqa: ANN001, ANN201
    _callers()[1](p, values, n, acc, ahead)


# Groups of 1 to 4 query heads a KV head take their own loops over bfloat16 rows
# (vectors.GROUPS), 5 the general ones.
@pytest.mark.parametrize("group", [1, GROUP, 5])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_run_scores_are_each_token_dot_each_query_head_and_write_n_lanes(dtype: str,
                                                                         group: int):
    heads = group * KV_HEADS
    gen = np.random.default_rng(0)
    keys, exact = cache_rows(dtype, gen)
    ahead = cache_rows(dtype, gen)[0]
    q = gen.standard_normal((heads, DIM)).astype(np.float32)
    for n in range(1, TOKENS + 1):
        for asked in (ahead, ahead[:0]):  # with a block to ask for, and without
            out = np.full((heads, 20), 7.0, np.float32)
            run_scores(q, keys, n, out, asked)
            want = np.einsum("khd,tkd->kht", q.reshape(KV_HEADS, group, DIM).astype(np.float64),
                             exact[:n]).reshape(heads, n)
            np.testing.assert_allclose(out[:, :n], want, rtol=1e-5, atol=1e-5)
            assert (out[:, n:] == 7.0).all()  # the lanes past the run are not stored


@pytest.mark.parametrize("group", [1, GROUP, 5])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_run_values_add_the_weighted_rows_of_the_run_alone(dtype: str, group: int):
    heads = group * KV_HEADS
    gen = np.random.default_rng(1)
    values, exact = cache_rows(dtype, gen)
    ahead = cache_rows(dtype, gen)[0]
    for n in range(1, TOKENS + 1):
        for asked in (ahead, ahead[:0]):
            p = np.full((heads, 20), np.nan, np.float32)  # weights past the run are not read
            p[:, :n] = gen.random((heads, n), dtype=np.float32)
            acc = gen.standard_normal((heads, DIM)).astype(np.float32)
            weighted = np.einsum("kht,tkd->khd", p[:, :n].reshape(KV_HEADS, group, n)
                                 .astype(np.float64), exact[:n]).reshape(heads, DIM)
            want = acc.astype(np.float64) + weighted
            run_values(p, values, n, acc, asked)
            np.testing.assert_allclose(acc, want, rtol=1e-5, atol=1e-5)


def test_head_dims_that_are_not_multiples_of_16_keep_the_plain_loops():
    from rvllm.kernels.cpu.vectors import supports

    assert [d for d in (8, 16, 20, 64, 80, 96, 128, 256) if supports(d)] == [16, 64, 80, 96,
                                                                             128, 256]
