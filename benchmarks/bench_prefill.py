#!/usr/bin/env python3
"""Prefill tok/s at given prompt lengths, against the device's own bf16 matmul peak, and
the paged prefill attention kernel against PyTorch's SDPA at those lengths.

    python benchmarks/bench_prefill.py --shape qwen2.5-7b --device cuda --dtype bfloat16
    python benchmarks/bench_prefill.py --shape qwen2.5-7b --layers 1 --lens 32,64 \\
        --repeats 1                                                   # a check on the CPU

One sequence per run: a prompt of L random token ids computed in one step (chunked
prefill is given L tokens a step) for one new token. The model's work per prompt is
2 x (its linear layers' weights, LM head for the last token only) x L multiply-adds, plus
causal attention's 2 x 2 x layers x heads x head_dim x L^2 / 2; divided by the time, that
is the rate the prefill reaches, reported beside a large bf16 matmul's rate on the same
device (``--peak-size``), measured in the same run. ``--shape qwen2.5-7b`` runs random
weights (``load_format="dummy"``) in Qwen2.5-7B's shape; ``--model`` a dense checkpoint
(the weights are counted from its config).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_shapes import add_model_args, model_and_kwargs  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--lens", default="512,2048", help="comma-separated prompt lengths")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-size", type=int, default=8192,
                   help="M = N = K of the matmul timed for the peak (0: skip it)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args()


def sync(device) -> None:  # noqa: ANN001
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device, dtype, size: int, iters: int = 20) -> float:  # noqa: ANN001
    """Multiply-add rate of a size^3 matmul in ``dtype`` on ``device``, in TFLOP/s."""
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b)
    sync(device)
    return 2 * size**3 * iters / (time.perf_counter() - start) / 1e12


def attention_vs_sdpa(cfg: dict, device, dtype, length: int) -> dict:  # noqa: ANN001
    """The paged prefill attention kernel on one L-token prompt (no cached prefix) against
    causal SDPA on the same shapes, ms each."""
    import torch
    import torch.nn.functional as F

    from rvllm.kernels.triton.prefill_attention import paged_prefill_attention

    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    block = 16
    blocks = math.ceil(length / block)
    q = torch.randn(length, heads, head_dim, device=device, dtype=dtype)
    key_cache, value_cache = (torch.randn(blocks, block, kv_heads, head_dim, device=device,
                                          dtype=dtype) for _ in range(2))
    tables = torch.arange(blocks, device=device, dtype=torch.int32).view(1, blocks)
    starts = torch.tensor([0, length], device=device, dtype=torch.int32)
    lens = torch.tensor([length], device=device, dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    k = key_cache.view(-1, kv_heads, head_dim)[:length].transpose(0, 1).unsqueeze(0)
    v = value_cache.view(-1, kv_heads, head_dim)[:length].transpose(0, 1).unsqueeze(0)
    qs = q.transpose(0, 1).unsqueeze(0)

    def timed(fn) -> float:  # noqa: ANN001
        fn()
        sync(device)
        start = time.perf_counter()
        for _ in range(10):
            fn()
        sync(device)
        return (time.perf_counter() - start) * 1e3 / 10

    paged = timed(lambda: paged_prefill_attention(q, key_cache, value_cache, tables, starts,
                                                  lens, length, scale))
    sdpa = timed(lambda: F.scaled_dot_product_attention(qs, k.contiguous(), v.contiguous(),
                                                        is_causal=True, scale=scale,
                                                        enable_gqa=True))
    return {"paged_prefill_attention_ms": round(paged, 4), "sdpa_causal_ms": round(sdpa, 4),
            "ratio_to_sdpa": round(paged / sdpa, 2)}


def main() -> None:
    a = parse_args()
    import torch

    from rvllm import LLM, SamplingParams
    from rvllm.bench.report import machine_info, write_json
    from rvllm.layers.backend import use_triton

    lens = [int(n) for n in a.lens.split(",")]
    model, kwargs = model_and_kwargs(a)
    llm = LLM(model, max_num_seqs=1, max_num_batched_tokens=max(lens),
              max_model_len=max(lens) + 8, enable_prefix_caching=False, **kwargs)
    engine = llm.engine
    mc = engine.model_config
    cfg = mc.hf_config
    device, dtype = engine.device, mc.dtype
    # The layers' linear weights of a dense model, from its config (packed or quantized
    # weights no longer show their element counts).
    inter = cfg["intermediate_size"]
    attn_width = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
    linear = mc.num_layers * mc.hidden_size * (attn_width + mc.num_heads * mc.head_dim
                                               + 3 * inter)
    head = mc.vocab_size * mc.hidden_size
    layers, heads, head_dim = mc.num_layers, mc.num_heads, mc.head_dim
    vocab = mc.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = []
    for length in lens:
        times = []
        for r in range(a.repeats + 1):  # the first compiles and picks kernels: unmeasured
            prompt = torch.randint(3, vocab, (length,), generator=gen).tolist()
            sync(device)
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            sync(device)
            if r:
                times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        flops = 2 * linear * length + 2 * head + 2 * 2 * layers * heads * head_dim * length**2 / 2
        row = {"prompt_len": length, "prefill_s": round(seconds, 4),
               "prefill_tok_s": round(length / seconds, 1),
               "tflops": round(flops / seconds / 1e12, 4)}
        if use_triton():
            row.update(attention_vs_sdpa(cfg, device, dtype, length))
        rows.append(row)
        print(json.dumps(row), flush=True)
    peak = matmul_tflops(device, dtype, a.peak_size) if a.peak_size else None
    for row in rows:
        row["share_of_matmul_peak"] = round(row["tflops"] / peak, 3) if peak else None
    result = {"benchmark": "prefill", "model": mc.path, "shape": a.shape,
              "layers": layers, "dtype": str(dtype).removeprefix("torch."),
              "device": str(device), "kernel_backend": engine.kernel_backend,
              "linear_weights": linear, "matmul_peak_tflops": peak and round(peak, 2),
              "peak_size": a.peak_size, "repeats": a.repeats, "machine": machine_info(),
              "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    if a.json:
        write_json(a.json, result)


if __name__ == "__main__":
    main()
