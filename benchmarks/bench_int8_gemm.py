"""int8 GEMMs on the CPU: ``kernels.cpu.int8_gemm`` against fbgemm's, side by side (with
``--float32``: ``kernels.cpu.f32_gemm`` against oneDNN's packed float32 GEMM).

SmolLM2's four projections a layer (QKV 576 x 960, output 576 x 576, gate/up 576 x 3072,
down 1536 x 576) with random int8 weights, for each row count:
- "memory": 30 layers' weights (106 MB, more than the L3), each GEMM once a pass, as a
  batch step reads them;
- "cache": one layer's four weights, again and again (in the L2 and L3);
- "LM head": 576 x 49152 (28 MB).
Each figure is the best of three passes, in GOP/s (two operations a multiply-add), the
two kernels in turns.

    python benchmarks/bench_int8_gemm.py [--rows 8,32,128,512] [--float32]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from rvllm.kernels.cpu.f32_gemm import float32_matmul
from rvllm.kernels.cpu.gemv import panels
from rvllm.kernels.cpu.int8_gemm import int8_matmul
from rvllm.layers.cpu_linear import _int8_tensor

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N)
LAYERS = 30


def weights(k: int, n: int, float32: bool) -> tuple:
    if float32:
        w = torch.randn(n, k)
        return panels(w), torch.ops.mkldnn._reorder_linear_weight(w, None)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 0.01 + 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = torch.ops.quantized.linear_prepack(_int8_tensor(q, scale), None)
    return panels(q, scale), packed


def best_rate(work: float, run, *args, passes: int = 3) -> float:
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        run(*args)
        best = min(best, time.perf_counter() - t)
    return work / best / 1e9


def ours(x: torch.Tensor, w: tuple) -> None:
    int8_matmul(x, w[0])


def ours_float32(x: torch.Tensor, w: tuple) -> None:
    float32_matmul(x, w[0])


def onednn(x: torch.Tensor, w: tuple) -> None:
    torch.ops.mkldnn._linear_pointwise(x, w[1], None, "none", [], "")


def fbgemm(x: torch.Tensor, w: tuple) -> None:
    torch.ops.quantized.linear_dynamic(x, w[1], True)


def layers(gemm, xs: dict, stack: list, repeat: int) -> None:
    for _ in range(repeat):
        for layer in stack:
            for (k, _), w in zip(SHAPES, layer):
                gemm(xs[k], w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,32,128,512")
    parser.add_argument("--float32", action="store_true")
    ns = parser.parse_args()
    torch.manual_seed(0)
    stack = [[weights(k, n, ns.float32) for k, n in SHAPES] for _ in range(LAYERS)]
    head = weights(576, 49152, ns.float32)
    kernels = ((("numba float32 GEMM", ours_float32), ("oneDNN", onednn)) if ns.float32 else
               (("numba int8 GEMM", ours), ("fbgemm", fbgemm)))
    layer_ops = 2 * sum(k * n for k, n in SHAPES)
    print("rows | kernel | memory | cache | LM head   (GOP/s)")
    for rows in (int(r) for r in ns.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k, _ in SHAPES}
        repeat = max(1, 2000 // rows)
        for name, gemm in kernels:
            layers(gemm, xs, stack, 1)
            memory = best_rate(layer_ops * LAYERS * rows, layers, gemm, xs, stack, 1)
            cache = best_rate(layer_ops * repeat * rows, layers, gemm, xs, stack[:1], repeat)
            lm = (f"{best_rate(2 * 576 * 49152 * rows, gemm, xs[576], head):.0f}"
                  if rows <= 128 else "-")
            print(f"{rows} | {name} | {memory:.0f} | {cache:.0f} | {lm}", flush=True)


if __name__ == "__main__":
    main()
