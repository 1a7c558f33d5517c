"""numba's thread count matched to torch's, per calling thread."""

from __future__ import annotations

import threading

import torch

# Per calling thread: torch's thread count when last matched, and numba's count then.
_matched = threading.local()


def match_torch_threads() -> int:
    """Give numba's kernels as many threads as torch has in the calling thread, and
    return that count (what a kernel takes as its thread count). Both counts are per
    calling thread, and torch's is set per process (a tensor-parallel rank, a
    data-parallel replica: a share of the cores), so the thread that steps the engine
    checks once per decode step (``decode_attention.step_arrays``). When torch's
    count is the one this thread last matched, numba is not asked again: the two calls
    into numba cost 20-30 us of a one-row decode step, run on code that the step's
    weights had pushed out of the caches (this package alone sets numba's count)."""
    torch_threads = torch.get_num_threads()
    known = getattr(_matched, "counts", None)
    if known is not None and known[0] == torch_threads:
        return known[1]
    import numba

    want = min(torch_threads, numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
    _matched.counts = (torch_threads, want)
    return want
