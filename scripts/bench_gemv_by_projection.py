"""The one-row panel GEMV (``kernels/cpu_gemv._matvec``) over a model's own weights, one
projection of every layer at a time (all the layers' QKV, then all their output
projections, ...), against a read of the same bytes (``bench_n1_bandwidth.read_vectors``),
alternated in one process (issue 6, session 22).

Each projection's rate, as a share of the read, shows what a GEMV's start and end cost
beside its bytes: the small projections of a model like SmolLM2 (1.3 MB a layer's output
projection) come in further below the read than its LM head (113 MB).

    python scripts/bench_gemv_by_projection.py --model MODEL [--quantization int8]
        [--rounds 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_n1_bandwidth import read_vectors  # noqa: E402

from rvllm import LLM  # noqa: E402
from rvllm.kernels.cpu_gemv import _EMPTY, Panels, _matvec  # noqa: E402


def chain(weights: list[Panels], parts: int) -> Callable[[], None]:
    """One GEMV a weight, in turn, each on a row of its own."""
    rng = np.random.default_rng(0)
    xs = [rng.random((1, w.weight.shape[1]), dtype=np.float32) for w in weights]
    outs = [np.empty((1, w.weight.shape[0] * w.weight.shape[2]), np.float32) for w in weights]

    def run() -> None:
        for x, w, out in zip(xs, weights, outs):
            _matvec(x, w.weight, w.scale, _EMPTY, out, parts)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rounds", type=int, default=16)
    ns = parser.parse_args()
    llm = LLM(ns.model, quantization=ns.quantization)
    groups: dict[str, list[Panels]] = {}
    for name, module in llm.engine.model.named_modules():
        if getattr(module, "panel_weight", None) is not None:
            groups.setdefault(name.rsplit(".", 1)[-1], []).append(module.panel_weight)
    parts = numba.get_num_threads()
    sizes = {name: sum(w.nbytes for w in ws) for name, ws in groups.items()}
    total = sum(sizes.values())
    buf = np.random.default_rng(0).random((total // 4096, 1024), dtype=np.float32)
    runs = {name: chain(ws, parts) for name, ws in groups.items()}
    for run in runs.values():
        run()  # compile or load
    rates: dict[str, list[float]] = {name: [] for name in ("read", *runs)}
    for _ in range(ns.rounds):
        start = time.perf_counter()
        read_vectors(buf, parts)
        rates["read"].append(total / (time.perf_counter() - start))
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            rates[name].append(sizes[name] / (time.perf_counter() - start))
    read = statistics.median(rates["read"])
    print(f"{ns.model} ({ns.quantization or 'float32'}), {parts} threads; read of "
          f"{total / 1e6:.0f} MB: median {read / 1e9:.1f} GB/s")
    for name, ws in groups.items():
        rate = statistics.median(rates[name])
        per = (statistics.median([sizes[name] / r for r in rates[name]])
               - sizes[name] / read) / len(ws)
        print(f"{name:14s} {len(ws):3d} x {ws[0].nbytes / 1e6:7.2f} MB: {rate / 1e9:5.1f} GB/s, "
              f"{rate / read:4.0%} of the read ({per * 1e6:+.1f} us a GEMV beyond the read)")


if __name__ == "__main__":
    main()
