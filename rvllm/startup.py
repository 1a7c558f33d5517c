"""The cyclic garbage collector while one of rvllm's commands starts.

Start-up makes a few hundred thousand objects that live as long as the process (torch's
import, the model, the tokenizer, numba's typing). The collector's full passes over them
took 0.5-0.7 s of an ``rvllm serve`` start on a 2-core machine. So the commands, which own
their process, pause it first thing (``pause_collector``) and resume it once their engine is
up (``resume_collector``), with everything made so far frozen out of its scans
(``gc.freeze``): a full pass over those objects later would only be a pause in serving.
Start-up's cyclic garbage is frozen with them: a few thousand function, cell and typing
objects (no tensors), collected never instead of once.
"""

from __future__ import annotations

import gc

_paused = False


def pause_collector() -> None:
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_collector(freeze: bool = True) -> None:
    """Undo ``pause_collector``, freezing what exists first unless ``freeze`` is False (a
    command that ends early); a no-op where it did not pause the collector."""
    global _paused
    if _paused:
        _paused = False
        if freeze:
            gc.freeze()
        gc.enable()
