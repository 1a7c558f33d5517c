"""Where an engine process's start goes: the steps of ``LLMEngine(...)`` on a timeline,
the main thread's beside the numba warm-up thread's, as ``rvllm serve`` starts its engine
(weight reorders deferred). Seconds from this script's start.

    .venv/bin/python scripts/startup_timeline.py [--model M]

Run it from another tree with ``cd TREE && PYTHONPATH=TREE python .../startup_timeline.py``
to compare two versions (alternate them: this machine's speed moves within minutes).
"""

from __future__ import annotations

import argparse
import importlib
import threading
import time
from collections.abc import Callable
from typing import Any

T0 = time.perf_counter()
MARKS: list[tuple[float, str, str]] = []


def mark(what: str) -> None:
    MARKS.append((time.perf_counter() - T0, threading.current_thread().name, what))


def timed(owner: Any, name: str, label: str | None = None) -> None:
    """Mark the start and end of every call of ``owner.name``."""
    inner: Callable[..., Any] = getattr(owner, name)
    label = label or name

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(f"{label} start")
        try:
            return inner(*args, **kwargs)
        finally:
            mark(f"{label} end")

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the built-in default model")
    parser.add_argument("--no-defer", action="store_true",
                        help="import all of torch first (as a library user's process does)")
    args = parser.parse_args()
    from rvllm.startup import pause_collector

    pause_collector()
    if not args.no_defer:
        from rvllm.deferred_imports import defer_torch_meta_registrations

        defer_torch_meta_registrations()  # as the server's engine process does
    import torch  # noqa: F401 - its import is the first step of an engine process

    mark("import torch end")
    from rvllm import kernels
    from rvllm.config import EngineArgs
    from rvllm.engine import llm_engine
    from rvllm.layers import cpu_linear
    from rvllm.models import base, loader

    for owner, name in ((llm_engine, "load_model"), (llm_engine, "load_tokenizer"),
                        (base.CausalLM, "load_weights"), (loader, "prepare_linear_weights")):
        timed(owner, name)
    original = llm_engine.ModelConfig.from_path.__func__

    def from_path(cls: type, *a: Any, **k: Any) -> Any:
        mark("model config start")
        config = original(cls, *a, **k)
        mark("model config end")
        return config

    llm_engine.ModelConfig.from_path = classmethod(from_path)
    warm_up = kernels.warm_up_numba

    def warm_up_marked(*a: Any, **k: Any) -> None:
        mark("numba warm-up start")
        for name in ("cpu_dequant", "cpu_decode_attention", "cpu_gemv", "cpu_decoder_step",
                     "cpu_batch_step", "cpu_greedy"):
            module = importlib.import_module(f"rvllm.kernels.{name}")
            timed(module, "warm_up", f"{name}.warm_up")
        warm_up(*a, **k)

    kernels.warm_up_numba = warm_up_marked
    engine_args = EngineArgs(defer_weight_packing=True)
    if args.model:
        engine_args.model = args.model
    engine = llm_engine.LLMEngine(engine_args)
    mark("engine ready")
    for at, thread, what in MARKS:
        print(f"{at:7.3f}  {thread[:20]:20s}  {what}")
    print("pending reorders:", cpu_linear.has_pending_reorders(engine.model))


if __name__ == "__main__":
    main()
