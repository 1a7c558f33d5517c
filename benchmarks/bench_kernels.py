"""Time each Triton kernel against its plain-torch reference at Qwen2.5-7B shapes.

    python benchmarks/bench_kernels.py --out results.json            # CUDA, bf16
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --quick    # tiny shapes, a CPU smoke run

The fused decode GEMVs (``--fused-decode-gemv``) are timed against the separate kernels
they replace (the norm or SiLU * mul kernel, then cuBLAS), with the weight's read in
GB/s, and beside cuBLAS and the plain Triton GEMV alone. Besides the reference,
attention is timed against the torch paths the engine could take instead: the batched
gather + SDPA of layers/attention.py for decode, and PyTorch's causal SDPA (flash on GPU)
per sequence for prefill without a cached prefix. Also reports each kernel's max error
against the reference at these shapes, and how long the start-up self-check takes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rvllm.kernels.triton import check_kernels  # noqa: E402
from rvllm.kernels.triton.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from rvllm.kernels.triton.decode_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_ref,
)
from rvllm.kernels.triton.fused_gemv import gemv, norm_gemv, silu_mul_gemv  # noqa: E402
from rvllm.kernels.triton.greedy import greedy_sample, greedy_sample_ref  # noqa: E402
from rvllm.kernels.triton.prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from rvllm.kernels.triton.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref  # noqa: E402
from rvllm.kernels.triton.rotary_kv import (  # noqa: E402
    rotary_embedding_with_kv_cache,
    rotary_embedding_with_kv_cache_ref,
)


@dataclass(frozen=True)
class Shapes:
    hidden: int = 3584  # Qwen2.5-7B
    intermediate: int = 18944
    vocab: int = 152064
    num_heads: int = 28
    num_kv_heads: int = 4
    head_dim: int = 128
    block_size: int = 16
    tokens: tuple[int, ...] = (1, 128, 4096)
    batches: tuple[int, ...] = (1, 32, 128)
    decode: tuple[tuple[int, int], ...] = ((1, 512), (1, 8192), (32, 1024), (128, 1024))
    prefill: tuple[tuple[int, int, int], ...] = ((1, 2048, 0), (8, 512, 0), (4, 256, 1024))
    gemv_rows: tuple[int, ...] = (1, 4)
    iters: int = 20


QUICK = Shapes(hidden=64, intermediate=96, vocab=1000, num_heads=4, num_kv_heads=2,
               head_dim=32, tokens=(1, 8), batches=(1, 8), decode=((2, 40),),
               prefill=((2, 20, 0), (2, 8, 12)), gemv_rows=(1, 3), iters=2)


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean milliseconds per call, after one warm-up call (which compiles)."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters


def max_err(got: object, want: object) -> float:
    pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
    return max((g.float() - w.float()).abs().max().item() for g, w in pairs)


def paged_setup(sh: Shapes, dev, dtype, num_seqs: int, max_len: int):
    blocks_per_seq = math.ceil(max_len / sh.block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, sh.block_size, sh.num_kv_heads, sh.head_dim)
    key_cache, value_cache = (torch.randn(shape, device=dev, dtype=dtype) for _ in range(2))
    tables = torch.randperm(num_blocks, device=dev).view(num_seqs, blocks_per_seq).int()
    return key_cache, value_cache, tables


def decode_gather_sdpa(q, key_cache, value_cache, tables, seq_lens, scale):
    """The engine's plain-torch decode: gather every slot, masked SDPA, GQA."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    max_len = tables.shape[1] * block_size
    pos = torch.arange(max_len, device=q.device)
    slots = tables.long()[:, pos // block_size] * block_size + pos % block_size
    keys = key_cache.view(-1, num_kv_heads, head_dim)[slots].transpose(1, 2)
    values = value_cache.view(-1, num_kv_heads, head_dim)[slots].transpose(1, 2)
    mask = (pos.unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :]
    return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask,
                                          scale=scale, enable_gqa=True).squeeze(2)


def sdpa_causal_per_seq(q, kv, scale):
    """PyTorch's causal SDPA (flash on GPU) on contiguous per-sequence tensors."""
    return [F.scaled_dot_product_attention(q[i:i + 1], kv[i:i + 1], kv[i:i + 1],
                                           is_causal=True, scale=scale, enable_gqa=True)
            for i in range(q.shape[0])]


class Bench:
    def __init__(self, sh: Shapes, dev: torch.device, dtype: torch.dtype) -> None:
        self.sh, self.dev, self.dtype = sh, dev, dtype
        self.rows: list[dict] = []

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.dev, dtype=self.dtype)

    def record(self, kernel: str, shape: str, fns: dict[str, Callable[[], object]],
               err: float | None = None) -> None:
        """Time every fn; 'triton' and 'ref' are also compared unless ``err`` is given."""
        row: dict = {"kernel": kernel, "shape": shape, "dtype": str(self.dtype)}
        row["max_abs_err"] = max_err(fns["triton"](), fns["ref"]()) if err is None else err
        for name, fn in fns.items():
            row[f"{name}_ms"] = round(timed(fn, self.dev, self.sh.iters), 4)
        row["speedup_vs_ref"] = round(row["ref_ms"] / row["triton_ms"], 2)
        print(json.dumps(row), flush=True)
        self.rows.append(row)

    def run(self) -> list[dict]:
        sh = self.sh
        for t in sh.tokens:
            x, res, w = self.randn(t, sh.hidden), self.randn(t, sh.hidden), self.randn(sh.hidden)
            self.record("fused_add_rms_norm", f"T={t} H={sh.hidden}", {
                "triton": partial(fused_add_rms_norm, x, res, w, 1e-6),
                "ref": partial(fused_add_rms_norm_ref, x, res, w, 1e-6)})
        for t in sh.tokens:
            x = self.randn(t, 2 * sh.intermediate)
            self.record("silu_and_mul", f"T={t} I={sh.intermediate}", {
                "triton": partial(silu_and_mul, x), "ref": partial(silu_and_mul_ref, x)})
        for t in sh.gemv_rows:
            self.fused_gemvs(t)
        for t in sh.tokens:
            self.rotary(t)
        for b in sh.batches:
            logits = self.randn(b, sh.vocab)
            self.record("greedy_sample", f"B={b} V={sh.vocab}", {
                "triton": partial(greedy_sample, logits),
                "ref": partial(greedy_sample_ref, logits)})
        for b, ctx in sh.decode:
            self.decode(b, ctx)
        for n, q_len, ctx in sh.prefill:
            self.prefill(n, q_len, ctx)
        return self.rows

    def fused_gemvs(self, t: int) -> None:
        """A decoder layer's three fused GEMVs: norm into QKV and into gate/up, SiLU * mul
        into down; each against the separate kernels, cuBLAS and the plain Triton GEMV."""
        sh = self.sh
        hidden, inter = sh.hidden, sh.intermediate
        qkv = (sh.num_heads + 2 * sh.num_kv_heads) * sh.head_dim
        x, res, norm_w = self.randn(t, hidden), self.randn(t, hidden), self.randn(hidden)
        act = self.randn(t, 2 * inter)
        for name, n, k in (("qkv", qkv, hidden), ("gate_up", 2 * inter, hidden),
                           ("down", hidden, inter)):
            weight = self.randn(n, k) / math.sqrt(k)
            if name == "down":
                fns = {"triton": partial(silu_mul_gemv, act, weight),
                       "ref": lambda w=weight: F.linear(silu_and_mul(act), w)}
                plain = act[:, :inter].contiguous()
            else:
                fns = {"triton": lambda w=weight: norm_gemv(x, res, norm_w, 1e-6, w)[0],
                       "ref": lambda w=weight: F.linear(
                           fused_add_rms_norm(x, res, norm_w, 1e-6)[0], w)}
                plain = x
            fns["cublas_only"] = partial(F.linear, plain, weight)
            fns["triton_gemv_only"] = partial(gemv, plain, weight)
            self.record(f"fused_gemv_{name}", f"T={t} N={n} K={k}", fns)
            row = self.rows[-1]
            for key in ("triton", "ref", "cublas_only", "triton_gemv_only"):
                # The weight's bytes over the time: the bandwidth each path reads it at.
                row[f"{key}_weight_gbps"] = round(weight.nbytes / row[f"{key}_ms"] / 1e6, 1)

    def rotary(self, t: int) -> None:
        sh, dev = self.sh, self.dev
        hq, hk, d = sh.num_heads, sh.num_kv_heads, sh.head_dim
        q, k, v = self.randn(t, hq, d), self.randn(t, hk, d), self.randn(t, hk, d)
        positions = torch.randint(0, 4096, (t,), device=dev)
        slots = torch.randperm(t * 2, device=dev)[:t]
        emb = torch.randn(4096, d, device=dev)
        caches = [torch.zeros(math.ceil(2 * t / sh.block_size), sh.block_size, hk, d, device=dev,
                              dtype=self.dtype) for _ in range(2)]
        args = (positions, q, k, v, emb.cos(), emb.sin(), *caches, slots)
        # q, k and the caches are written in place (again on every timed call), so the
        # comparison runs on fresh copies; outputs at indices 1, 2, 6, 7.
        copies = [tuple(x.clone() for x in args) for _ in range(2)]
        rotary_embedding_with_kv_cache(*copies[0])
        rotary_embedding_with_kv_cache_ref(*copies[1])
        err = max_err(*(tuple(c[i] for i in (1, 2, 6, 7)) for c in copies))
        self.record("rotary_embedding_with_kv_cache", f"T={t} Hq={hq} Hk={hk} D={d}", {
            "triton": partial(rotary_embedding_with_kv_cache, *args),
            "ref": partial(rotary_embedding_with_kv_cache_ref, *args)}, err)

    def decode(self, b: int, ctx: int) -> None:
        sh = self.sh
        key_cache, value_cache, tables = paged_setup(sh, self.dev, self.dtype, b, ctx)
        q = self.randn(b, sh.num_heads, sh.head_dim)
        lens = torch.full((b,), ctx, device=self.dev, dtype=torch.int32)
        args = (q, key_cache, value_cache, tables, lens, 1 / math.sqrt(sh.head_dim))
        self.record("paged_decode_attention", f"B={b} ctx={ctx}", {
            "triton": partial(paged_decode_attention, *args, partition_size=None),
            "ref": partial(paged_decode_attention_ref, *args),
            "triton_split512": partial(paged_decode_attention, *args, partition_size=512),
            "torch_gather_sdpa": partial(decode_gather_sdpa, *args)})

    def prefill(self, n: int, q_len: int, ctx: int) -> None:
        sh, dev = self.sh, self.dev
        key_cache, value_cache, tables = paged_setup(sh, dev, self.dtype, n, ctx + q_len)
        q = self.randn(n * q_len, sh.num_heads, sh.head_dim)
        starts = torch.arange(0, n * q_len + 1, q_len, device=dev, dtype=torch.int32)
        lens = torch.full((n,), ctx + q_len, device=dev, dtype=torch.int32)
        scale = 1 / math.sqrt(sh.head_dim)
        args = (q, key_cache, value_cache, tables, starts, lens, q_len, scale)
        fns = {"triton": partial(paged_prefill_attention, *args),
               "ref": partial(paged_prefill_attention_ref, *args)}
        if ctx == 0:
            qs = q.view(n, q_len, sh.num_heads, sh.head_dim).transpose(1, 2)
            kv = self.randn(n, sh.num_kv_heads, q_len, sh.head_dim)
            fns["torch_sdpa_causal"] = partial(sdpa_causal_per_seq, qs, kv, scale)
        self.record("paged_prefill_attention", f"seqs={n} q_len={q_len} cached={ctx}", fns)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    args = parser.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    start = time.perf_counter()
    check_kernels(dev, dtype)
    result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": __import__("triton").__version__,
              "check_kernels_s": round(time.perf_counter() - start, 2)}
    print(json.dumps(result), flush=True)
    with torch.inference_mode():
        result["cases"] = Bench(QUICK if args.quick else Shapes(), dev, dtype).run()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
