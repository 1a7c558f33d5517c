"""One-row GEMVs over a model-shaped stack of float32 weights, by weight layout, against a
plain read of the same matrices, alternated in one process (issue 6, session 15).

- ``read``: each matrix summed, each thread its share of the rows in order (one stream);
- ``row-major, eight lanes``: each thread's share as eight streams of rows far apart (the
  GEMV before the panels);
- ``row-major, in order``: one row after another;
- ``panels``: ``kernels.cpu_gemv`` (16 rows column by column, four streams a thread);
- ``one buffer, vector streams``: a read of one buffer of the same bytes, four streams of
  16-lane loads a thread (``bench_n1_bandwidth.read_vectors``, the N=1 target's limit):
  against ``read``, what reading the stack matrix by matrix costs;
- ``panels, one matrix``: the panel GEMV over one matrix of the same bytes (the stack's
  first column count): against the buffer's read, what the GEMV's arithmetic costs.

    python scripts/bench_gemv_layouts.py [--shape llama|smollm2] [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
from numba import prange

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_n1_bandwidth import read_vectors  # noqa: E402

from rvllm.kernels.cpu_gemv import _EMPTY, _matvec, gemv, panels  # noqa: E402

SHAPES = {  # (rows, cols) of each layer's qkv, o, gate/up, down, then the LM head
    "llama": [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12 + [(32000, 768)],
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)],
}


@numba.njit(fastmath=True, inline="always")
def _dot(w, r, x):
    acc = np.float32(0.0)
    for i in range(w.shape[1]):
        acc += w[r, i] * x[i]
    return acc


@numba.njit(parallel=True, fastmath=True)
def read(x, w, out, parts):
    n = w.shape[0]
    for part in prange(parts):
        lo, hi = n * part // parts, n * (part + 1) // parts
        total = np.float32(0.0)
        for r in range(lo, hi):
            for i in range(w.shape[1]):
                total += w[r, i]
        out[0, lo] = total


@numba.njit(parallel=True, fastmath=True)
def row_major_in_order(x, w, out, parts):
    n = w.shape[0]
    for part in prange(parts):
        for r in range(n * part // parts, n * (part + 1) // parts):
            out[0, r] = _dot(w, r, x[0])


@numba.njit(parallel=True, fastmath=True)
def row_major_eight_lanes(x, w, out, parts):
    n, k = w.shape
    for part in prange(parts):
        lo, hi = n * part // parts, n * (part + 1) // parts
        q = (hi - lo) // 8
        for r in range(lo, lo + q):
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
            for i in range(k):
                xi = x[0, i]
                a0 += w[r, i] * xi
                a1 += w[r + q, i] * xi
                a2 += w[r + 2 * q, i] * xi
                a3 += w[r + 3 * q, i] * xi
                a4 += w[r + 4 * q, i] * xi
                a5 += w[r + 5 * q, i] * xi
                a6 += w[r + 6 * q, i] * xi
                a7 += w[r + 7 * q, i] * xi
            for j, a in enumerate((a0, a1, a2, a3, a4, a5, a6, a7)):
                out[0, r + j * q] = a
        for r in range(lo + 8 * q, hi):
            out[0, r] = _dot(w, r, x[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama")
    parser.add_argument("--rounds", type=int, default=12)
    ns = parser.parse_args()
    rng = np.random.default_rng(0)
    weights = [rng.random(s, dtype=np.float32) for s in SHAPES[ns.shape]]
    packed = [panels(torch.from_numpy(w)) for w in weights]
    xs = [torch.from_numpy(rng.random((1, w.shape[1]), dtype=np.float32)) for w in weights]
    outs = [np.empty((1, w.shape[0]), np.float32) for w in weights]
    parts = numba.get_num_threads()
    nbytes = sum(w.nbytes for w in weights)

    def plain(kernel):  # noqa: ANN001, ANN202
        def run() -> None:
            for x, w, out in zip(xs, weights, outs):
                kernel(x.numpy(), w, out, parts)
        return run

    def with_panels() -> None:  # the kernel gemv calls, into the same outputs
        for x, w, out in zip(xs, packed, outs):
            _matvec(x.numpy(), w.weight, w.scale, _EMPTY, out, parts)

    buffer = rng.random((nbytes // 4096, 1024), dtype=np.float32)
    cols = weights[0].shape[1]
    big = panels(torch.from_numpy(rng.random((nbytes // 4 // cols, cols), dtype=np.float32)))
    big_x, big_out = xs[0].numpy(), np.empty((1, big.rows), np.float32)
    variants = {"read": plain(read), "row-major, eight lanes": plain(row_major_eight_lanes),
                "row-major, in order": plain(row_major_in_order), "panels": with_panels,
                "one buffer, vector streams": lambda: read_vectors(buffer, parts),
                "panels, one matrix": lambda: _matvec(big_x, big.weight, big.scale, _EMPTY,
                                                      big_out, parts)}
    np.testing.assert_allclose(gemv(xs[0], packed[0]).numpy(), xs[0].numpy() @ weights[0].T,
                               rtol=1e-4)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for run in variants.values():
        run()  # compile
    for _ in range(ns.rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    print(f"{ns.shape}: {len(weights)} weights, {nbytes / 1e6:.0f} MB, {parts} threads")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{name:28s} median {median * 1e3:7.2f} ms  {nbytes / median / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
