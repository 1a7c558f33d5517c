"""Host memory backed by transparent huge pages, for the large arrays the CPU kernels
stream through: the weight panels of the one-row GEMV (``gemv.panels``). (The KV
cache was, until its first writes were timed: ``executor.kv_cache.empty_cpu_cache``.)

With 4 KiB pages, a read of a weight stream crosses a page every 64 lines: each crossing
is a TLB miss whose page walk reads tables the streaming weights keep pushing out of the
caches, and a hardware prefetcher that starts over at the page. With 2 MiB pages those go
away. ``madvise(MADV_HUGEPAGE)`` asks the kernel for them where transparent huge pages are
``madvise`` (the default of many distributions, and this project's machines); where they
are ``always`` it changes nothing, and where ``never``, or off Linux, the memory is
ordinary.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import numpy as np
import torch

_MADV_HUGEPAGE = 14  # Linux
_MADV_COLLAPSE = 25  # Linux 6.1
_MADV_POPULATE_WRITE = 23  # Linux 5.14
PAGE = 4096
HUGE_PAGE = 2 << 20


def empty_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose whole 2 MiB pages the kernel is asked to back with
    huge pages, before anything touches them (a tensor smaller than a huge page is left
    alone)."""
    tensor = torch.empty(shape, dtype=dtype)
    _advise(tensor.data_ptr(), tensor.numel() * tensor.element_size(), _MADV_HUGEPAGE)
    return tensor


def collapse_huge_pages(array: np.ndarray) -> bool:
    """Move the whole 2 MiB pages of memory already written (a numpy array's) into huge
    pages where they are, its addresses unchanged (``MADV_COLLAPSE``, Linux 6.1 and
    later; elsewhere nothing happens). A copy in the kernel, outside the GIL: about 1.5 ms
    a MB here, so for idle time. Returns whether the kernel did it."""
    return _advise(array.ctypes.data, array.nbytes, _MADV_COLLAPSE)


def populate(address: int, nbytes: int) -> bool:
    """Fault in the pages of [address, address + nbytes) for writing now, their contents
    unchanged (``MADV_POPULATE_WRITE``, Linux 5.14 and later; elsewhere nothing happens).
    On a virtual machine whose host takes back free memory, a fresh page's first write
    costs 40-80 us here: done while idle, not inside a decode step. Returns whether the
    kernel did it."""
    if nbytes <= 0:
        return False
    start = address // PAGE * PAGE
    return _madvise(start, -(-(address + nbytes) // PAGE) * PAGE, _MADV_POPULATE_WRITE)


def _advise(address: int, nbytes: int, advice: int) -> bool:
    """``advice`` for the whole huge pages within [address, address + nbytes)."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    return _madvise(start, (address + nbytes) // HUGE_PAGE * HUGE_PAGE, advice)


def _madvise(start: int, end: int, advice: int) -> bool:
    """madvise over [start, end) (page-aligned); False off Linux or for an empty range."""
    if not sys.platform.startswith("linux") or end <= start:
        return False
    return _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) == 0


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
