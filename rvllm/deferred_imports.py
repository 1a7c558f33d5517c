"""torch's Python meta kernels, imported once an engine is up instead of with torch.

``import torch`` ends by importing ``torch._meta_registrations``, and with it ``torch._prims``,
``torch._refs`` and ``torch._decomp``: the Python rules for the shapes of meta and fake
tensors, which ``torch.compile``, ``torch.export`` and models built on the meta device use.
An engine running eager CPU or CUDA kernels on real tensors uses none of them, and on a
2-core machine they were 0.35-0.6 s of a 1.1-1.8 s ``import torch``: the largest part of the
time from ``rvllm serve``'s launch to its first completion that was not the engine's own.

So the engine's process asks for them to be left out before it imports torch
(``defer_torch_meta_registrations``: a placeholder module stands in the one name torch's
``__init__`` imports), and its engine imports them for real in idle time, a module at a
time (``import_next``, from ``LLMEngine.idle_work``), after the start-up work it defers
itself. Once they are in, the process's torch is the whole torch again. Only a process
that owns its interpreter does this (the server's engine process): a library user's torch
is never changed.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types

logger = logging.getLogger("rvllm")

_META = "torch._meta_registrations"
# What the meta registrations import, in order, the largest first: each is one slice
# (0.05-0.15 s on a 2-core machine) of the idle time they are imported in.
_PIECES = ("torch._prims", "torch._refs", "torch._decomp", _META)
_deferred: list[str] = []


def defer_torch_meta_registrations() -> bool:
    """Before ``import torch``: leave its Python meta kernels out until ``import_next``
    brings them in. Returns whether they will be deferred (not when torch is already
    imported, or when another caller asked first)."""
    if "torch" in sys.modules or _deferred:
        return False
    sys.modules[_META] = types.ModuleType(_META, "placeholder until rvllm's engine idles")
    _deferred.extend(_PIECES)
    return True


def has_deferred() -> bool:
    """Whether some of torch's modules are still left for ``import_next``."""
    return bool(_deferred)


def import_for_generators() -> None:
    """Import the deferred modules up to ``torch._prims`` now: torch (2.13) refuses to
    make a ``torch.Generator`` before its ``rng_prims`` are in. For a seeded request, or
    dummy weights, before idle time has brought them in."""
    while "torch._prims" in _deferred:
        import_next()


def import_next() -> bool:
    """Import the next deferred module of torch; returns whether any are left."""
    if not _deferred:
        return False
    name = _deferred.pop(0)
    if name == _META:
        del sys.modules[_META]
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - idle work must not end the engine's loop
        logger.warning("could not import %s after start-up: torch's meta kernels stay out",
                       name, exc_info=True)
        _deferred.clear()
    return bool(_deferred)
