"""Work claimed in phases inside one parallel region (kernels/cpu/sync.py): every item of
a phase is done once, its tail once after all of them and before any item of the next
phase, however many iterations the region has on however many threads."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

# rvllm.kernels is imported inside the tests: test_kernels.py must be first to import it.


@cache  # compiled once for all the cases, not once each
def _phased_region():  # noqa: ANN202
    import numba

    from rvllm.kernels.cpu.sync import claim, finish, phases, publish, wait

    @numba.njit(parallel=True)
    def run(items, iterations, done_count, tails):
        """Phase p's item i records the tail of the phase before (tails[p - 1]) plus i;
        the tail of phase p: the sum of its items' records, modulo 1009."""
        num_phases = done_count.shape[0]
        counters = phases(num_phases)
        records = np.zeros((num_phases, items), np.int64)
        for _ in numba.prange(iterations):
            for p in range(num_phases):
                item = claim(counters, p)
                while item < items:
                    before = tails[p - 1] if p > 0 else 0
                    records[p, item] = before + item
                    if finish(counters, p, items):
                        tails[p] = records[p].sum() % 1009
                        done_count[p] = items
                        publish(counters, p)
                    item = claim(counters, p)
                wait(counters, p)
        return records

    return run


@pytest.mark.parametrize("iterations", [1, 2, 5])
@pytest.mark.parametrize("items", [1, 2, 7])
def test_phases_run_each_item_once_and_each_tail_after_them(iterations: int,
                                                            items: int) -> None:
    run = _phased_region()
    done_count = np.zeros(40, np.int64)
    tails = np.zeros(40, np.int64)
    records = run(items, iterations, done_count, tails)
    expected_tail = 0
    for p in range(40):
        want = [expected_tail + i for i in range(items)]
        assert records[p].tolist() == want
        expected_tail = sum(want) % 1009
        assert tails[p] == expected_tail
    assert done_count.tolist() == [items] * 40
