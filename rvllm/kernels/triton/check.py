"""Start-up self-check: each kernel against its reference on a small input.

The inputs are small but cover the paths a model takes: GQA, a context that
crosses cache blocks, split-KV, a cached prefix, a sliding window; for the quantized
linear layers the GEMV and the GEMM, split-K, a K padded to a whole int4 chunk, an N
that is no multiple of the tile; for the FP8 KV cache its write, decode and prefill; for
the fused decode GEMVs one and three rows, with and without a residual.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rvllm.kernels.triton import (
    activation,
    decode_attention,
    fp8_linear,
    fused_gemv,
    greedy,
    kv_fp8,
    prefill_attention,
    rms_norm,
    rotary_kv,
    w4a16,
)

Outputs = tuple[torch.Tensor, ...]

# atol = rtol. The attention kernels compute float32 in full precision (no TF32).
TOLERANCE = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _rms_norm(dev: torch.device, dtype: torch.dtype) -> tuple[Outputs, Outputs]:
    x = torch.randn(3, 80, device=dev, dtype=dtype)
    w = torch.randn(80, device=dev, dtype=dtype)
    return (rms_norm.rms_norm(x, w, 1e-6),), (rms_norm.rms_norm_ref(x, w, 1e-6),)


def _fused_add_rms_norm(dev: torch.device, dtype: torch.dtype) -> tuple[Outputs, Outputs]:
    x, res = (torch.randn(3, 80, device=dev, dtype=dtype) for _ in range(2))
    w = torch.randn(80, device=dev, dtype=dtype)
    return (rms_norm.fused_add_rms_norm(x, res, w, 1e-6),
            rms_norm.fused_add_rms_norm_ref(x, res, w, 1e-6))


def _rotary(dev: torch.device, dtype: torch.dtype) -> tuple[Outputs, Outputs]:
    num_tokens, head_dim = 5, 32
    q = torch.randn(num_tokens, 4, head_dim, device=dev, dtype=dtype)
    k, v = (torch.randn(num_tokens, 2, head_dim, device=dev, dtype=dtype) for _ in range(2))
    freqs = torch.outer(torch.arange(64.0), 1e4 ** -(torch.arange(0, head_dim, 2) / head_dim))
    emb = torch.cat((freqs, freqs), dim=-1).to(dev)
    positions = torch.tensor([0, 7, 16, 33, 63], device=dev)
    slots = torch.tensor([2, 9, -1, 31, 16], device=dev)
    results = []
    for fn in (rotary_kv.rotary_embedding_with_kv_cache,
               rotary_kv.rotary_embedding_with_kv_cache_ref):
        caches = [torch.zeros(2, 16, 2, head_dim, device=dev, dtype=dtype) for _ in range(2)]
        q_out, k_out = fn(positions, q.clone(), k.clone(), v, emb.cos(), emb.sin(), *caches,
                          slots)
        results.append((q_out, k_out, *caches))
    return results[0], results[1]


def _paged_inputs(dev: torch.device, dtype: torch.dtype, num_seqs: int, num_heads: int,
                  num_kv_heads: int, head_dim: int = 32) -> tuple[torch.Tensor, ...]:
    block_size, blocks_per_seq = 16, 4
    num_blocks = num_seqs * blocks_per_seq + 1
    key_cache, value_cache = (
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=dev, dtype=dtype)
        for _ in range(2)
    )
    tables = torch.randperm(num_blocks, device=dev)[: num_seqs * blocks_per_seq]
    return key_cache, value_cache, tables.view(num_seqs, blocks_per_seq).int()


def _decode(dev: torch.device, dtype: torch.dtype) -> tuple[Outputs, Outputs]:
    key_cache, value_cache, tables = _paged_inputs(dev, dtype, 3, 8, 2)
    q = torch.randn(3, 8, 32, device=dev, dtype=dtype)
    seq_lens = torch.tensor([1, 17, 50], device=dev, dtype=torch.int32)
    args = (q, key_cache, value_cache, tables, seq_lens, 1 / math.sqrt(32))
    ref = decode_attention.paged_decode_attention_ref(*args)
    single = decode_attention.paged_decode_attention(*args, partition_size=None)
    split = decode_attention.paged_decode_attention(*args, partition_size=32, block_n=16)
    return (single, split), (ref, ref)


def _prefill(dev: torch.device, dtype: torch.dtype) -> tuple[Outputs, Outputs]:
    key_cache, value_cache, tables = _paged_inputs(dev, dtype, 2, 4, 1)
    q = torch.randn(25, 4, 32, device=dev, dtype=dtype)
    query_start_loc = torch.tensor([0, 20, 25], device=dev, dtype=torch.int32)
    seq_lens = torch.tensor([20, 40], device=dev, dtype=torch.int32)  # second has a prefix
    args = (q, key_cache, value_cache, tables, query_start_loc, seq_lens, 20, 1 / math.sqrt(32))
    out = prefill_attention.paged_prefill_attention(*args, block_m=16, block_n=16)
    return (out,), (prefill_attention.paged_prefill_attention_ref(*args),)


def _silu_and_mul(dev: torch.device, dtype: torch.dtype) -> tuple[Outputs, Outputs]:
    x = torch.randn(3, 160, device=dev, dtype=dtype)
    return (activation.silu_and_mul(x),), (activation.silu_and_mul_ref(x),)


def _greedy(dev: torch.device, dtype: torch.dtype) -> tuple[Outputs, Outputs]:
    logits = torch.randn(3, 1000, device=dev, dtype=dtype)
    return greedy.greedy_sample(logits, block=256), greedy.greedy_sample_ref(logits)


def _w4a16(dev: torch.device, dtype: torch.dtype) -> tuple[Outputs, Outputs]:
    n, k, group = 72, 384, 128  # K pads to 512 (chunks of 256)
    q = torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8)
    zero = torch.randint(0, 16, (n, k // group), device=dev).float()
    scale = (0.5 + torch.rand(n, k // group, device=dev)) / (8 * math.sqrt(k))
    packed = w4a16.pack_w4a16(q, scale, zero, group)
    bias = torch.randn(n, device=dev, dtype=dtype)
    got, want = [], []
    for rows, split in ((1, None), (3, 2), (20, None), (20, 2)):
        x = torch.randn(rows, k, device=dev, dtype=dtype)
        got.append(w4a16.w4a16_linear(x, packed, bias, split_k=split))
        want.append(w4a16.w4a16_reference(x, q, scale, zero, group, bias))
    return tuple(got), tuple(want)


def _fp8_linear(dev: torch.device, dtype: torch.dtype) -> tuple[Outputs, Outputs]:
    n, k = 72, 200
    weight, scale = fp8_linear.quantize_fp8_weight(
        torch.randn(n, k, device=dev) / math.sqrt(k))
    bias = torch.randn(n, device=dev, dtype=dtype)
    got, want = [], []
    for rows, split in ((1, None), (3, 2), (20, None), (20, 2)):
        x = torch.randn(rows, k, device=dev, dtype=dtype)
        got.append(fp8_linear.fp8_linear(x, weight, scale, bias, split_k=split))
        want.append(fp8_linear.fp8_linear_reference(x, weight, scale, bias))
    return tuple(got), tuple(want)


def _fused_gemv(dev: torch.device, dtype: torch.dtype) -> tuple[Outputs, Outputs]:
    n, k = 72, 200  # a K past one tile, an N no multiple of the programs' outputs
    weight = torch.randn(n, k, device=dev, dtype=dtype) / math.sqrt(k)
    down = torch.randn(n, k // 2, device=dev, dtype=dtype) / math.sqrt(k // 2)
    norm_weight = torch.randn(k, device=dev, dtype=dtype)
    bias = torch.randn(n, device=dev, dtype=dtype)
    got: list[torch.Tensor] = []
    want: list[torch.Tensor] = []
    for rows in (1, 3):
        x, res = (torch.randn(rows, k, device=dev, dtype=dtype) for _ in range(2))
        for residual in (res, None):
            got += fused_gemv.norm_gemv(x, residual, norm_weight, 1e-6, weight, bias, block_n=16)
            want += fused_gemv.norm_gemv_ref(x, residual, norm_weight, 1e-6, weight, bias)
        got.append(fused_gemv.silu_mul_gemv(x, down, block_n=16))
        want.append(fused_gemv.silu_mul_gemv_ref(x, down))
    return tuple(got), tuple(want)


def _fp8_kv_cache(dev: torch.device, dtype: torch.dtype) -> tuple[Outputs, Outputs]:
    """The write into an FP8 cache (against quantizing the kernel's own rotated keys: the
    rotation is the rotary check's), then decode and prefill attention over it."""
    num_tokens, head_dim = 5, 32
    q = torch.randn(num_tokens, 4, head_dim, device=dev, dtype=dtype)
    k, v = (torch.randn(num_tokens, 2, head_dim, device=dev, dtype=dtype) for _ in range(2))
    freqs = torch.outer(torch.arange(64.0), 1e4 ** -(torch.arange(0, head_dim, 2) / head_dim))
    emb = torch.cat((freqs, freqs), dim=-1).to(dev)
    positions = torch.tensor([0, 7, 16, 33, 63], device=dev)
    slots = torch.tensor([2, 9, -1, 31, 16], device=dev)
    kv_scale = kv_fp8.new_kv_scale(dev)
    kv_fp8.calibrate_kv_scale(kv_scale, k, v)
    caches = [torch.zeros(2, 16, 2, head_dim, device=dev, dtype=kv_fp8.KV_FP8_DTYPE)
              for _ in range(2)]
    _, k_out = rotary_kv.rotary_embedding_with_kv_cache(
        positions, q.clone(), k.clone(), v, emb.cos(), emb.sin(), *caches, slots, kv_scale)
    written = slots >= 0
    got: list[torch.Tensor] = []
    want: list[torch.Tensor] = []
    for cache, new, s in ((caches[0], k_out, kv_scale[0]), (caches[1], v, kv_scale[1])):
        # Bit-exact in tests; here within one E4M3 step (2^-3 relative, 2^-9 subnormal),
        # so a rounding tie decided otherwise by some GPU does not stop start-up.
        stored = cache.view(-1, 2, head_dim)[slots[written]].float()
        exact = kv_fp8.quantize_kv(new[written], s).float()
        got.append(((stored - exact).abs() <= exact.abs() / 8 + 2**-9).all())
        want.append(torch.tensor(True, device=dev))

    key_cache, value_cache, tables = _paged_inputs(dev, dtype, 3, 8, 2)
    key_cache, value_cache = (kv_fp8.quantize_kv(c, s) for c, s in
                              ((key_cache, kv_scale[0]), (value_cache, kv_scale[1])))
    q = torch.randn(3, 8, 32, device=dev, dtype=dtype)
    seq_lens = torch.tensor([1, 17, 50], device=dev, dtype=torch.int32)
    args = (q, key_cache, value_cache, tables, seq_lens, 1 / math.sqrt(32))
    got.append(decode_attention.paged_decode_attention(*args, partition_size=32, block_n=16,
                                                       kv_scale=kv_scale))
    want.append(decode_attention.paged_decode_attention_ref(*args, kv_scale=kv_scale))
    q = torch.randn(25, 8, 32, device=dev, dtype=dtype)
    query_start_loc = torch.tensor([0, 20, 25], device=dev, dtype=torch.int32)
    seq_lens = torch.tensor([20, 40], device=dev, dtype=torch.int32)
    args = (q, key_cache, value_cache, tables[:2], query_start_loc, seq_lens, 20,
            1 / math.sqrt(32))
    got.append(prefill_attention.paged_prefill_attention(*args, block_m=16, block_n=16,
                                                         kv_scale=kv_scale))
    want.append(prefill_attention.paged_prefill_attention_ref(*args, kv_scale=kv_scale))
    return tuple(got), tuple(want)


CASES: dict[str, Callable[[torch.device, torch.dtype], tuple[Outputs, Outputs]]] = {
    "rms_norm": _rms_norm,
    "fused_add_rms_norm": _fused_add_rms_norm,
    "rotary_embedding_with_kv_cache": _rotary,
    "paged_decode_attention": _decode,
    "paged_prefill_attention": _prefill,
    "silu_and_mul": _silu_and_mul,
    "greedy_sample": _greedy,
    "w4a16_linear": _w4a16,
    "fp8_linear": _fp8_linear,
    "fp8_kv_cache": _fp8_kv_cache,
    "fused_gemv": _fused_gemv,
}


def run_check(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """Run one kernel's check; RuntimeError (naming it and what to do) on any failure."""
    if name not in CASES:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(CASES)}.")
    advice = ("Run `pytest tests/test_kernels.py` on this machine to see the failing case; "
              "install the Triton version this PyTorch build pins, or use the plain-torch path.")
    where = f"on {device} in {str(dtype).removeprefix('torch.')}"
    try:
        # Seeded inputs, without disturbing the caller's random state.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            got, want = CASES[name](device, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:
        raise RuntimeError(f"Triton kernel {name} failed to compile or run {where}: "
                           f"{type(exc).__name__}: {exc}. {advice}") from exc
    tol = TOLERANCE.get(dtype, 1e-2)
    for g, w in zip(got, want):
        if g.is_floating_point():
            ok = torch.allclose(g.float(), w.float(), atol=tol, rtol=tol)
        else:
            ok = torch.equal(g, w)
        if not ok:
            err = (g.float() - w.float()).abs().max().item()
            raise RuntimeError(f"Triton kernel {name} does not match its plain-torch reference "
                               f"{where} (max abs error {err:.3g}, tolerance {tol}). {advice}")

