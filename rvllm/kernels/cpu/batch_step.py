"""Every step ``decoder_step`` does not take (a decode step of many sequences, or
any step with prefill chunks) through a Llama-shaped stack: the layers' own GEMMs
(over the weights' panels: ``int8_gemm``, ``f32_gemm``; else fbgemm's int8 or
oneDNN's float32) with everything between them in three numba calls a layer.

Past ``decoder_step``'s few rows a step is arithmetic-bound in its linear layers,
where the packed GEMMs win; but through the layers each of the ~45 torch operations a
layer around them (norms, the int8 path's per-row scaling, RoPE, the cache write,
SiLU*mul, the residual adds) costs a few microseconds to dispatch and another pass over
its tensor: at 32 decoding sequences they took as long as attention, and in a
2048-token prefill a fifth of the step. Here, per layer:

1. ``add_norm``: the residual add of the last projection's output (times its
   rows' scales, plus its bias), RMSNorm, and, for int8 weights, each row divided by
   its largest magnitude (fbgemm quantizes its whole input with one scale; this makes
   it per token, as the layers' int8 path does; ``int8_gemm`` quantizes each row
   on its own either way);
2. the QKV GEMM;
3. ``qkv_attention``: scales and bias, RoPE, the cache write, paged decode attention for
   the decode rows (``decode_attention``); prefill chunks then attend through their
   layer's attention (``prefill_attention``, or SDPA), as the layers do; then the
   rows' scaling for the output projection;
4. the output projection's GEMM, then ``add_norm`` again;
5. the gate/up GEMM, then ``silu_mul``: scales, bias, SiLU(gate) * up, scaling;
6. the down projection's GEMM, whose output the next layer's ``add_norm`` takes.

The loop over the layers, with its GEMMs and the prefill chunks' attention, is the
model's (``models/cpu_step.py``: ``batch_step``, over the stacks whose linear layers
are packed for oneDNN or int8); the layers are the reference it is tested against
(``tests/test_cpu_decoder_step.py``).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the cache
from rvllm.kernels.cpu.decode_attention import _paged_decode
from rvllm.kernels.cpu.numerics import exp32, kv_array, narrow_kv
from rvllm.kernels.cpu.step_parts import _rms_norm, _rope

_TINY = np.float32(1e-10)


@numba.njit(fastmath=True, cache=True, inline="always")
def _scale_row(x, b, scales, quantize):
    """Divide row b of x by its largest magnitude (kept in scales[b]) when quantizing."""
    if quantize:
        top = _TINY
        for i in range(x.shape[1]):
            top = max(top, abs(x[b, i]))
        inv = np.float32(1.0) / top
        for i in range(x.shape[1]):
            x[b, i] *= inv
        scales[b] = top


@numba.njit(parallel=True, fastmath=True, cache=True)
def add_norm(hidden, delta, delta_scale, delta_bias, weight, eps, normed, scales, quantize):
    """hidden += delta (times delta_scale [B], plus delta_bias [H]; an empty delta: no
    add), then normed = RMSNorm(hidden) * weight, each row scaled when quantizing."""
    rows, size = hidden.shape
    has_delta, has_scale = delta.shape[0] > 0, delta_scale.shape[0] > 0
    has_bias = delta_bias.shape[0] > 0
    for b in prange(rows):
        if has_delta:
            s = delta_scale[b] if has_scale else np.float32(1.0)
            for i in range(size):
                hidden[b, i] += delta[b, i] * s
            if has_bias:
                for i in range(size):
                    hidden[b, i] += delta_bias[i]
        _rms_norm(hidden[b:b + 1], weight, eps, normed[b:b + 1])
        _scale_row(normed, b, scales, quantize)


@numba.njit(parallel=True, fastmath=True, cache=True)
def qkv_attention(qkv, qkv_scale, qkv_bias, cos_table, sin_table, positions, slots, key_cache,
               value_cache, tables, lens, window, scale, num_splits, threads, q, out,
               out_scales, quantize):
    """Rows of qkv [T, Hq*D + 2*Hk*D] (times qkv_scale [T], plus qkv_bias), in place: RoPE
    on q and k at each row's position, then k and v written to the paged caches [blocks,
    block_size, Hk, D] at the row's slot (-1: nowhere) and q copied to q [T, Hq, D]. Then
    the first D = tables.shape[0] rows (the decodes) attend over their paged contexts into
    out [T, Hq*D]; when quantizing, every row of out is then scaled (so with prefill
    rows, whose attention is the caller's, pass quantize False and scale after).
    ``threads``: numba's thread count (``decode_attention._paged_decode``)."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    has_scale, has_bias = qkv_scale.shape[0] > 0, qkv_bias.shape[0] > 0
    for b in prange(rows):
        s = qkv_scale[b] if has_scale else np.float32(1.0)
        row = qkv[b]
        for i in range(row.shape[0]):
            row[i] *= s
        if has_bias:
            for i in range(row.shape[0]):
                row[i] += qkv_bias[i]
        # The q heads, then the k heads.
        _rope(row[:q_size + kv_size].reshape((num_heads + num_kv_heads, head_dim)),
              cos_table[positions[b]], sin_table[positions[b]])
        for h in range(num_heads):
            for d in range(head_dim):
                q[b, h, d] = row[h * head_dim + d]
        if slots[b] >= 0:
            block, offset = slots[b] // block_size, slots[b] % block_size
            for h in range(num_kv_heads):
                for d in range(head_dim):
                    key_cache[block, offset, h, d] = narrow_kv(
                        row[q_size + h * head_dim + d], key_cache)
                    value_cache[block, offset, h, d] = narrow_kv(
                        row[q_size + kv_size + h * head_dim + d], value_cache)
    decodes = tables.shape[0]
    if decodes > 0:
        _paged_decode(q[:decodes], key_cache, value_cache, tables, lens, scale, window,
                      np.float32(0.0), num_splits, threads,
                      out[:decodes].reshape((decodes, num_heads, head_dim)))
    scale_rows(out, out_scales, quantize)


@numba.njit(parallel=True, fastmath=True, cache=True)
def scale_rows(x, scales, quantize):
    if quantize:
        for b in prange(x.shape[0]):
            _scale_row(x, b, scales, quantize)


@numba.njit(parallel=True, fastmath=True, cache=True)
def silu_mul(gate_up, gu_scale, gu_bias, act, scales, quantize):
    """act [B, I] = SiLU(gate) * up of gate_up [B, 2I] (times gu_scale [B], plus gu_bias),
    each row scaled when quantizing."""
    rows, inter = act.shape
    has_scale, has_bias = gu_scale.shape[0] > 0, gu_bias.shape[0] > 0
    for b in prange(rows):
        s = gu_scale[b] if has_scale else np.float32(1.0)
        for i in range(inter):
            g, u = gate_up[b, i] * s, gate_up[b, i + inter] * s
            if has_bias:
                g += gu_bias[i]
                u += gu_bias[i + inter]
            act[b, i] = g / (np.float32(1.0) + exp32(-g)) * u
        _scale_row(act, b, scales, quantize)


def warm_up(kv_dtype: torch.dtype = torch.float32, int8: bool = True,
            float32: bool = True) -> None:
    """Compile (or load from numba's cache) the three kernels for float32 weights (unless
    not ``float32``) and with int8 scaling (when ``int8``), with a cache of ``kv_dtype``,
    so a model's first wide decode step does not pay for it."""
    rows, heads, kv_heads, dim = 1, 2, 1, 4
    hidden, inter = heads * dim, 4
    ones = np.ones(hidden, np.float32)
    for quantize in (False,) * float32 + (True,) * int8:
        scales = np.ones(rows if quantize else 0, np.float32)
        none = np.empty(0, np.float32)
        x = np.zeros((rows, hidden), np.float32)
        add_norm(x, np.empty((0, hidden), np.float32), none, none, ones, np.float32(1e-6),
                  np.empty_like(x), scales, quantize)
        qkv = np.zeros((rows, (heads + 2 * kv_heads) * dim), np.float32)
        cache = kv_array(torch.zeros((1, 4, kv_heads, dim), dtype=kv_dtype))
        rope = np.ones((4, dim), np.float32)
        zero = np.zeros(rows, np.int64)
        qkv_attention(qkv, scales, none, rope, rope, zero, zero, cache, cache,
                   np.zeros((rows, 1), np.int64), zero + 1, np.int64(0), np.float32(1.0),
                   np.int64(1), np.int64(1), np.empty((rows, heads, dim), np.float32),
                   np.empty((rows, heads * dim), np.float32), scales, quantize)
        scale_rows(np.ones((rows, hidden), np.float32), scales, quantize)
        silu_mul(np.zeros((rows, 2 * inter), np.float32), scales, none,
                  np.empty((rows, inter), np.float32), scales, quantize)
