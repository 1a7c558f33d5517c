"""Decode-step costs of the GPU's quantized paths at Qwen2.5-7B shapes, as JSON.

    python benchmarks/bench_gpu_quant.py                    # CUDA (H100/H200), < 3 minutes
    python benchmarks/bench_gpu_quant.py --rows 1,4,8,16    # also where GEMV and GEMM cross
    python benchmarks/bench_gpu_quant.py --dry-run          # CPU, Triton's interpreter, tiny

Linear layers: one token's (``--rows``) pass through each layer's four projections (qkv
4608 x 3584, o 3584 x 3584, gate_up 37888 x 3584, down 3584 x 18944) with bfloat16
weights (``F.linear``, cuBLAS), int4 weights (``w4a16``, group 128, round to nearest)
and FP8 weights (``fp8_linear``). ``--layers`` distinct layers (default 4: 1.9 GB in
bfloat16, far past the L2 cache) are timed and scaled to the model's 28; every projection
is timed on its own too, with the bandwidth its weight bytes imply.

Attention: paged decode attention of ``--batch`` sequences (default 128) of ``--context``
tokens (default 1024) over one layer's cache (28 query heads, 4 KV heads of 128), a
bfloat16 cache against an FP8 one (``kv_fp8``), scaled to 28 layers.

Each measurement is a CUDA graph of the calls (as the engine's decode runs), replayed
``--iters`` times between CUDA events. Errors: each quantized output against the
bfloat16 one, relative in norm.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = dict(hidden=3584, intermediate=18944, num_heads=28, num_kv_heads=4, head_dim=128,
             num_layers=28)
TINY = dict(hidden=64, intermediate=160, num_heads=4, num_kv_heads=2, head_dim=32,
            num_layers=2)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU in Triton's interpreter, no timings")
    p.add_argument("--layers", type=int, default=4, help="distinct layers timed (scaled to 28)")
    p.add_argument("--rows", default="1", help="comma-separated token counts (decode rows)")
    p.add_argument("--batch", type=int, default=128, help="decode attention sequences")
    p.add_argument("--context", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--iters", type=int, default=50, help="graph replays per measurement")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.dry_run:
        # Before any kernel module is imported: triton.jit reads it at definition.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    dev = torch.device("cpu" if args.dry_run else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu_quant needs a CUDA GPU; use --dry-run for a CPU smoke run.")
    shapes = TINY if args.dry_run else MODEL
    if args.dry_run:
        args.layers, args.batch, args.context, args.iters = 2, 2, 40, 0
    torch.manual_seed(0)
    started = time.perf_counter()
    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
        "dry_run": args.dry_run, "shapes": shapes, "layers_timed": args.layers,
        "iters": args.iters,
        "linear": bench_linear(dev, shapes, args),
        "attention": bench_attention(dev, shapes, args),
    }
    result["seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def time_ms(fn: Callable[[], object], iters: int) -> float | None:
    """Milliseconds per call of ``fn`` captured as a CUDA graph (compiled and warmed up
    first); None with no iterations (a dry run: one plain call)."""
    import torch

    if iters == 0:
        fn()
        return None
    fn()  # compile
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def relative_error(got, want) -> float:  # noqa: ANN001
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def bench_linear(dev, shapes: dict, args: argparse.Namespace) -> dict:  # noqa: ANN001
    import torch
    import torch.nn.functional as F

    from rvllm.kernels.triton.fp8_linear import (
        fp8_linear,
        fp8_linear_reference,
        quantize_fp8_weight,
    )
    from rvllm.kernels.triton.w4a16 import pack_w4a16, w4a16_linear, w4a16_reference
    from rvllm.models.int4_checkpoint import quantize_int4_rtn

    h, inter = shapes["hidden"], shapes["intermediate"]
    heads, kv, hd = shapes["num_heads"], shapes["num_kv_heads"], shapes["head_dim"]
    projections = {"qkv": ((heads + 2 * kv) * hd, h), "o": (heads * hd, h),
                   "gate_up": (2 * inter, h), "down": (h, inter)}
    group = 128 if h % 128 == 0 and inter % 128 == 0 else 32
    act = torch.bfloat16 if dev.type == "cuda" else torch.float16  # interpreter: no bf16 dot
    layers = []  # per layer: {projection: (bf16 weight, int4 packed + unpacked, fp8)}
    for _ in range(args.layers):
        layer = {}
        for name, (n, k) in projections.items():
            w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
            rtn = quantize_int4_rtn(w, group)
            layer[name] = dict(bf16=w.to(act), int4=pack_w4a16(rtn.q, rtn.scale, rtn.zero, group),
                               int4_raw=rtn, fp8=quantize_fp8_weight(w))
        layers.append(layer)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    scale_to_model = shapes["num_layers"] / args.layers
    out: dict = {"group": group, "rows": {}}
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {name: torch.randn(rows, k, device=dev, dtype=act)
              for name, (_, k) in projections.items()}
        kinds: dict[str, Callable] = {
            "bf16": lambda w, x: F.linear(x, w["bf16"]),
            "w4a16": lambda w, x: w4a16_linear(x, w["int4"]),
            "fp8": lambda w, x: fp8_linear(x, *w["fp8"]),
        }
        if rows > 1:  # both int4 kernels at this row count, for GEMV_MAX_ROWS
            kinds["w4a16_gemv"] = lambda w, x: w4a16_linear(x, w["int4"], gemv_max_rows=1 << 20)
            kinds["w4a16_gemm"] = lambda w, x: w4a16_linear(x, w["int4"], gemv_max_rows=0)
            kinds["fp8_gemv"] = lambda w, x: fp8_linear(x, *w["fp8"], gemv_max_rows=1 << 20)
            kinds["fp8_gemm"] = lambda w, x: fp8_linear(x, *w["fp8"], gemv_max_rows=0)
        per_rows: dict = {}
        for kind, fn in kinds.items():
            entry: dict = {}
            for name in projections:
                ms = time_ms(lambda fn=fn, name=name, xs=xs: [fn(layer[name], xs[name])
                                                              for layer in layers], args.iters)
                weight_bytes = sum(_weight_bytes(layer[name], kind) for layer in layers)
                entry[name] = _timing(ms, args.layers, weight_bytes)
            ms = time_ms(lambda fn=fn, xs=xs: [fn(layer[name], xs[name]) for layer in layers
                                               for name in projections], args.iters)
            entry["all_28_layers_us"] = None if ms is None else round(ms * 1e3 * scale_to_model,
                                                                     1)
            first = layers[0]
            entry["error_vs_bf16"] = {
                name: round(relative_error(fn(first[name], xs[name]),
                                           F.linear(xs[name], first[name]["bf16"])), 5)
                for name in projections}
            per_rows[kind] = entry
        # The kernels against their own references on the same quantized weights.
        w = layers[0]["o"]
        x = xs["o"]
        per_rows["error_vs_reference"] = {
            "w4a16": round(relative_error(w4a16_linear(x, w["int4"]), w4a16_reference(
                x, w["int4_raw"].q, w["int4_raw"].scale, w["int4_raw"].zero, group)), 6),
            "fp8": round(relative_error(fp8_linear(x, *w["fp8"]),
                                        fp8_linear_reference(x, *w["fp8"])), 6),
        }
        out["rows"][str(rows)] = per_rows
    return out


def _weight_bytes(w: dict, kind: str) -> int:
    if kind == "bf16":
        return w["bf16"].nbytes
    if kind.startswith("w4a16"):
        return w["int4"].nbytes()
    return w["fp8"][0].nbytes + w["fp8"][1].nbytes


def _timing(ms: float | None, layers: int, nbytes: int) -> dict:
    if ms is None:
        return {"us_per_layer": None, "GB_per_s": None}
    return {"us_per_layer": round(ms * 1e3 / layers, 2),
            "GB_per_s": round(nbytes / (ms * 1e-3) / 1e9, 1)}


def bench_attention(dev, shapes: dict, args: argparse.Namespace) -> dict:  # noqa: ANN001
    import torch

    from rvllm.kernels.triton import kv_fp8
    from rvllm.kernels.triton.decode_attention import (
        paged_decode_attention,
        paged_decode_attention_ref,
    )

    heads, kv, hd = shapes["num_heads"], shapes["num_kv_heads"], shapes["head_dim"]
    batch, context, block_size = args.batch, args.context, 16
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16  # interpreter: no bf16 dot
    key_cache = torch.randn(num_blocks, block_size, kv, hd, device=dev, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    tables = torch.randperm(num_blocks, device=dev).int().view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    q = torch.randn(batch, heads, hd, device=dev, dtype=dtype)
    scale = 1 / math.sqrt(hd)
    kv_scale = kv_fp8.new_kv_scale(dev)
    kv_fp8.calibrate_kv_scale(kv_scale, key_cache, value_cache)
    key_fp8 = kv_fp8.quantize_kv(key_cache, kv_scale[0])
    value_fp8 = kv_fp8.quantize_kv(value_cache, kv_scale[1])
    runs = {
        "bf16": (key_cache, value_cache, None),
        "fp8": (key_fp8, value_fp8, kv_scale),
    }
    out: dict = {"batch": batch, "context": context}
    results = {}
    for kind, (kc, vc, s) in runs.items():
        fn = lambda kc=kc, vc=vc, s=s: paged_decode_attention(  # noqa: E731
            q, kc, vc, tables, seq_lens, scale, kv_scale=s)
        ms = time_ms(fn, args.iters)
        results[kind] = fn()
        nbytes = kc.nbytes + vc.nbytes
        entry = _timing(ms, 1, nbytes)
        entry["all_28_layers_us"] = (None if ms is None
                                     else round(ms * 1e3 * shapes["num_layers"], 1))
        entry["cache_MB_per_layer"] = round(nbytes / 2**20, 1)
        out[kind] = entry
    out["fp8_error_vs_bf16"] = round(relative_error(results["fp8"], results["bf16"]), 5)
    if dev.type == "cpu" or batch <= 8:
        ref = paged_decode_attention_ref(q, key_fp8, value_fp8, tables, seq_lens, scale,
                                         kv_scale=kv_scale)
        out["fp8_error_vs_reference"] = round(relative_error(results["fp8"], ref), 6)
    return out


if __name__ == "__main__":
    main()
