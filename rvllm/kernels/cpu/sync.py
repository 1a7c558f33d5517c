"""Work shared out inside one parallel region of numba's threads, in phases.

A one-row decode step runs about 150 dependent pieces of parallel work (four
projections and an attention a layer, then the LM head). As a ``prange`` loop each, every
piece paid a fork and a join of numba's threads, and the threads waited with the
memory idle. Here the step's threads enter one ``prange`` loop once, and each phase's work
items are claimed from a counter in shared memory:

- ``claim`` hands out a phase's items [0, n) one at a time, whoever asks first;
- ``finish`` tells a thread whether the item it just did was the phase's last to end:
  that thread then does the phase's serial tail (a residual add, a norm, RoPE) and
  ``publish`` marks the phase done;
- ``wait`` spins until a phase is done (``done`` and ``spin``, for a caller that has
  something to do meanwhile).

A thread waits only on a phase whose every item has been claimed, that is, on threads
that are running it: the step cannot deadlock however numba places the region's
iterations on threads (one thread that ran them all in turn would claim every item
itself). The counters are int64 slots a cache line apart (``phases``), fresh for each
step; the atomics are LLVM's (sequentially consistent read-modify-write, release store,
acquire load), so what an item wrote is seen by the thread that takes the tail, and what
the tail wrote is seen by the threads that waited for it.
"""

from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the kernels' cache

_I64 = ir.IntType(64)
SLOT = 8  # int64 slots a counter takes: one 64-byte cache line each
COUNTERS = 3  # a phase's: items claimed, items finished, done
_PAUSE = {"x86_64": "llvm.x86.sse2.pause", "amd64": "llvm.x86.sse2.pause"}.get(
    platform.machine().lower())


def _slot(builder: ir.IRBuilder, address: ir.Value) -> ir.Value:
    return builder.inttoptr(address, _I64.as_pointer())


@intrinsic
def _fetch_add(typingctx, address, value):
    """The int64 at ``address`` before adding ``value`` to it, atomically."""
    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _slot(builder, args[0]), args[1], "seq_cst")
    return types.int64(types.int64, types.int64), codegen


@intrinsic
def _store_release(typingctx, address, value):
    def codegen(context, builder, signature, args):
        builder.store_atomic(args[1], _slot(builder, args[0]), "release", 8)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


@intrinsic
def _load_acquire(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_slot(builder, args[0]), "acquire", 8)
    return types.int64(types.int64), codegen


@intrinsic
def _spin_hint(typingctx):
    """x86's ``pause`` in a spin loop (the sibling hyperthread and the memory
    order machine are spared); nothing elsewhere."""
    def codegen(context, builder, signature, args):
        if _PAUSE is not None:
            hint = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), _PAUSE)
            builder.call(hint, [])
        return context.get_dummy_value()
    return types.void(), codegen


@numba.njit(cache=True)
def phases(count):
    """Counters for ``count`` phases, all zero."""
    return np.zeros(count * COUNTERS * SLOT, np.int64)


@numba.njit(cache=True, inline="always")
def _counter(counters, phase, which):
    return counters.ctypes.data + ((phase * COUNTERS + which) * SLOT) * 8


@numba.njit(cache=True, inline="always")
def claim(counters, phase):
    """The next unclaimed item of ``phase`` (items past its count mean none is left)."""
    return _fetch_add(_counter(counters, phase, 0), 1)


@numba.njit(cache=True, inline="always")
def finish(counters, phase, items):
    """Whether the item just done was the last of the phase's ``items`` to end."""
    return _fetch_add(_counter(counters, phase, 1), 1) == items - 1


@numba.njit(cache=True, inline="always")
def publish(counters, phase):
    """Mark ``phase`` done (after its tail)."""
    _store_release(_counter(counters, phase, 2), 1)


@numba.njit(cache=True, inline="always")
def done(counters, phase):
    """Whether ``phase`` is done."""
    return _load_acquire(_counter(counters, phase, 2)) != 0


@numba.njit(cache=True, inline="always")
def spin():
    """One turn of a spin loop."""
    _spin_hint()


@numba.njit(cache=True, inline="always")
def wait(counters, phase):
    """Until ``phase`` is done."""
    while not done(counters, phase):
        _spin_hint()
