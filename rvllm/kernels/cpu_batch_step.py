"""Every step ``cpu_decoder_step`` does not take (a decode step of many sequences, or
any step with prefill chunks) through a Llama-shaped stack: the layers' own GEMMs
(over the weights' panels: ``cpu_int8_gemm``, ``cpu_f32_gemm``; else fbgemm's int8 or
oneDNN's float32) with everything between them in three numba calls a layer.

Past ``cpu_decoder_step``'s few rows a step is arithmetic-bound in its linear layers,
where the packed GEMMs win; but through the layers each of the ~45 torch operations a
layer around them (norms, the int8 path's per-row scaling, RoPE, the cache write,
SiLU*mul, the residual adds) costs a few microseconds to dispatch and another pass over
its tensor: at 32 decoding sequences they took as long as attention, and in a
2048-token prefill a fifth of the step. Here, per layer:

1. ``_add_norm``: the residual add of the last projection's output (times its
   rows' scales, plus its bias), RMSNorm, and, for int8 weights, each row divided by
   its largest magnitude (fbgemm quantizes its whole input with one scale; this makes
   it per token, as the layers' int8 path does; ``cpu_int8_gemm`` quantizes each row
   on its own either way);
2. the QKV GEMM;
3. ``_attention``: scales and bias, RoPE, the cache write, paged decode attention for
   the decode rows (``cpu_decode_attention``); prefill chunks then attend through their
   layer's attention (``cpu_prefill_attention``, or SDPA), as the layers do; then the
   rows' scaling for the output projection;
4. the output projection's GEMM, then ``_add_norm`` again;
5. the gate/up GEMM, then ``_silu_mul``: scales, bias, SiLU(gate) * up, scaling;
6. the down projection's GEMM, whose output the next layer's ``_add_norm`` takes.

It serves the stacks ``cpu_decoder_step.build_plan`` accepts whose linear layers are
packed for oneDNN or int8; the layers are the reference it is tested against
(``tests/test_cpu_decoder_step.py``).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from rvllm.forward_context import AttentionMetadata
from rvllm.kernels import match_torch_threads, numba_cache  # noqa: F401 - stamps the cache
from rvllm.kernels.cpu_decode_attention import _paged_decode, step_arrays
from rvllm.kernels.cpu_f32_gemm import matmul_into as f32_matmul_into
from rvllm.kernels.cpu_gemv import embedding_rows
from rvllm.kernels.cpu_int8_gemm import matmul_into
from rvllm.kernels.cpu_math import exp32, kv_array, narrow_kv
from rvllm.kernels.cpu_step_parts import _rms_norm, _rope

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
def _add_norm(hidden, delta, delta_scale, delta_bias, weight, eps, normed, scales, quantize):
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
def _attention(qkv, qkv_scale, qkv_bias, cos_table, sin_table, positions, slots, key_cache,
               value_cache, tables, lens, window, scale, num_splits, threads, q, out,
               out_scales, quantize):
    """Rows of qkv [T, Hq*D + 2*Hk*D] (times qkv_scale [T], plus qkv_bias), in place: RoPE
    on q and k at each row's position, then k and v written to the paged caches [blocks,
    block_size, Hk, D] at the row's slot (-1: nowhere) and q copied to q [T, Hq, D]. Then
    the first D = tables.shape[0] rows (the decodes) attend over their paged contexts into
    out [T, Hq*D]; when quantizing, every row of out is then scaled (so with prefill
    rows, whose attention is the caller's, pass quantize False and scale after).
    ``threads``: numba's thread count (``cpu_decode_attention._paged_decode``)."""
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
    _scale_rows(out, out_scales, quantize)


@numba.njit(parallel=True, fastmath=True, cache=True)
def _scale_rows(x, scales, quantize):
    if quantize:
        for b in prange(x.shape[0]):
            _scale_row(x, b, scales, quantize)


@numba.njit(parallel=True, fastmath=True, cache=True)
def _silu_mul(gate_up, gu_scale, gu_bias, act, scales, quantize):
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


def _gemm(module: torch.nn.Module, x: torch.Tensor, threads: np.int64) -> torch.Tensor:
    """x W^T through the module's panels where it has them (``cpu_int8_gemm``,
    ``cpu_f32_gemm``), else its packed weight, with no bias and no scaling (the kernels
    around it apply those). ``threads``: numba's thread count."""
    if module.linear_kind == "int8":
        if module.packed_weight is None:
            panels = module.panel_weight
            out = torch.empty(x.shape[0], panels.rows)
            matmul_into(x.numpy(), panels.weight, panels.scale, out.numpy(), threads)
            return out
        return torch.ops.quantized.linear_dynamic(x, module.packed_weight, True)
    panels = getattr(module, "panel_weight", None)
    if panels is not None:  # float32 panels: cpu_f32_gemm, faster than oneDNN here
        out = torch.empty(x.shape[0], panels.rows)
        f32_matmul_into(x.numpy(), panels.weight, out.numpy(), threads)
        return out
    if module.packed_weight is None:  # its oneDNN reorder is still pending
        return torch.nn.functional.linear(x, module.weight)
    return torch.ops.mkldnn._linear_pointwise(x, module.packed_weight, None, "none", [], "")


def supported(plan) -> bool:  # noqa: ANN001 - a cpu_decoder_step.DecoderStepPlan
    """Whether every linear layer of the plan's stack is packed for oneDNN or fbgemm
    int8, all in one of the two."""
    kinds = {getattr(m, "linear_kind", None) for layer in plan.layers
             for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj)}
    return kinds in ({"int8"}, {"onednn"})


def batch_step(plan, token_ids: torch.Tensor, positions: np.ndarray,  # noqa: ANN001
               slots: np.ndarray, ctx: AttentionMetadata) -> torch.Tensor | None:
    """Final hidden states [T, H] of a step's T new tokens (token ids, their positions and
    cache slots, int64; ``ctx``: the step's attention metadata, decodes first), or None
    when the KV caches are not one stacked allocation, the linear layers are not all
    packed for oneDNN or fbgemm int8, or the decodes come without block tables. Prefill
    chunks attend through their layer's attention (``Attention.prefill_chunk``);
    everything else runs as for decodes."""
    caches = plan.caches()
    if "batch_ok" not in plan.__dict__:
        plan.batch_ok = supported(plan)
    if (caches is None or not plan.batch_ok
            or (ctx.num_decode_tokens and ctx.decode_block_tables is None)):
        return None
    match_torch_threads()
    threads = np.int64(numba.get_num_threads())
    rows, decodes = token_ids.shape[0], ctx.num_decode_tokens
    quantize = plan.like.dtype == np.int8
    hidden_t = embedding_rows(plan.embedding, token_ids)  # a copy: the residual stream
    hidden = hidden_t.numpy()
    normed_t = torch.empty_like(hidden_t)
    normed = normed_t.numpy()
    heads, dim = plan.num_heads, plan.head_dim
    attn_t = torch.empty(rows, heads * dim)
    act_t = torch.empty(rows, plan.inter)
    q_t = torch.empty(rows, heads, dim)
    in_scales = np.empty(rows if quantize else 0, np.float32)
    mid_scales = np.empty(rows if quantize else 0, np.float32)
    none = np.empty(0, np.float32)
    if decodes:
        tables, lens, num_splits = step_arrays(ctx.decode_block_tables, ctx.decode_seq_lens)
    else:
        tables, lens, num_splits = np.empty((0, 1), np.int64), np.empty(0, np.int64), 1
    prefills = ctx.prefills
    key_caches, value_caches = caches
    delta, delta_scale, delta_bias = np.empty((0, hidden.shape[1]), np.float32), none, none
    for i, layer in enumerate(plan.layers):
        attn, mlp = layer.self_attn, layer.mlp
        _add_norm(hidden, delta, delta_scale, delta_bias, plan.norms1[i], plan.eps, normed,
                  in_scales, quantize)
        qkv = _gemm(attn.qkv_proj, normed_t, threads)
        _attention(qkv.numpy(), in_scales, plan.qkv_b[i], plan.cos, plan.sin, positions,
                   slots, key_caches[i], value_caches[i], tables, lens, plan.windows[i],
                   plan.scale, np.int64(num_splits), threads, q_t.numpy(), attn_t.numpy(),
                   mid_scales, quantize and not prefills)
        if prefills:
            _prefill_attention(attn.attn, prefills, q_t, qkv, attn_t)
            _scale_rows(attn_t.numpy(), mid_scales, quantize)
        o = _gemm(attn.o_proj, attn_t, threads)
        _add_norm(hidden, o.numpy(), mid_scales, plan.o_b[i], plan.norms2[i], plan.eps,
                  normed, in_scales, quantize)
        gate_up = _gemm(mlp.gate_up_proj, normed_t, threads)
        _silu_mul(gate_up.numpy(), in_scales, plan.gu_b[i], act_t.numpy(), mid_scales,
                  quantize)
        delta = _gemm(mlp.down_proj, act_t, threads).numpy()
        delta_scale, delta_bias = mid_scales, plan.down_b[i]
    out = torch.empty_like(hidden_t)
    _add_norm(hidden, delta, delta_scale, delta_bias, plan.final_norm, plan.eps, out.numpy(),
              none, False)
    return out


def _prefill_attention(module: torch.nn.Module, prefills: list, q: torch.Tensor,
                       qkv: torch.Tensor, out: torch.Tensor) -> None:
    """Each prefill chunk's attention, as ``layers.attention.Attention`` computes it: over
    the chunk's own (rotated) keys and values when those are all it sees, else over its
    context gathered from the cache (which ``_attention`` has just written)."""
    heads, kv_heads, dim = module.num_heads, module.num_kv_heads, module.head_dim
    q_size, kv_size = heads * dim, kv_heads * dim
    keys_all = qkv[:, q_size:q_size + kv_size].view(-1, kv_heads, dim)
    values_all = qkv[:, q_size + kv_size:].view(-1, kv_heads, dim)
    key_flat = module.kv_cache[0].view(-1, kv_heads, dim)
    value_flat = module.kv_cache[1].view(-1, kv_heads, dim)
    for p in prefills:
        rows = slice(p.token_start, p.token_start + p.num_tokens)
        if module.sees_own_rows(p):
            keys, values = keys_all[rows], values_all[rows]
        else:
            keys = key_flat.index_select(0, p.slots).to(q.dtype)
            values = value_flat.index_select(0, p.slots).to(q.dtype)
        out[rows] = module.prefill_chunk(p, q[rows], keys, values).reshape(p.num_tokens, -1)


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
        _add_norm(x, np.empty((0, hidden), np.float32), none, none, ones, np.float32(1e-6),
                  np.empty_like(x), scales, quantize)
        qkv = np.zeros((rows, (heads + 2 * kv_heads) * dim), np.float32)
        cache = kv_array(torch.zeros((1, 4, kv_heads, dim), dtype=kv_dtype))
        rope = np.ones((4, dim), np.float32)
        zero = np.zeros(rows, np.int64)
        _attention(qkv, scales, none, rope, rope, zero, zero, cache, cache,
                   np.zeros((rows, 1), np.int64), zero + 1, np.int64(0), np.float32(1.0),
                   np.int64(1), np.int64(1), np.empty((rows, heads, dim), np.float32),
                   np.empty((rows, heads * dim), np.float32), scales, quantize)
        _scale_rows(np.ones((rows, hidden), np.float32), scales, quantize)
        _silu_mul(np.zeros((rows, 2 * inter), np.float32), scales, none,
                  np.empty((rows, inter), np.float32), scales, quantize)
