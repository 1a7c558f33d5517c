"""Host memory backed by transparent huge pages, for the large arrays the CPU kernels
stream through or touch anywhere: the weight panels of the one-row GEMV
(``cpu_gemv.panels``) and the KV cache (``executor.kv_cache.empty_cpu_cache``).

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

import torch

_MADV_HUGEPAGE = 14  # Linux
HUGE_PAGE = 2 << 20


def empty_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose whole 2 MiB pages the kernel is asked to back with
    huge pages, before anything touches them (a tensor smaller than a huge page is left
    alone)."""
    tensor = torch.empty(shape, dtype=dtype)
    if sys.platform.startswith("linux"):
        start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE_PAGE \
            * HUGE_PAGE
        if end > start:
            _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                            _MADV_HUGEPAGE)
    return tensor


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
