"""A decode step of a few sequences through a whole Llama-shaped decoder stack in one
numba call.

A decode step of one sequence reads every weight once and does little arithmetic on
each, so the linear layers alone (``cpu_gemv``) took about half of the step on this
class of CPU; the other half was the ~50 torch operations per layer around them (norms,
RoPE, the cache write, attention, SiLU*mul, the residual adds) and the Python that
drives them, each a few microseconds on a few rows. Here the whole stack runs in
compiled code: per layer, RMSNorm, the QKV projection, RoPE, the KV-cache write,
attention over the paged cache, the output projection, the residual add and RMSNorm,
gate/up with SiLU*mul fused into its rows, and the down projection. Each weight row is
read from memory once for all the step's sequences. The projections and attention run
on numba's threads (as many as torch's); the rest, a few thousand floats a row and
layer, runs on the calling thread.

Up to ``MAX_ROWS`` sequences with float32 weights, ``MAX_ROWS_INT8`` with int8: measured
on the random Llama (2 cores), past those the packed GEMMs win (fbgemm's int8 GEMMs
quantize the activations too; here every int8 weight is widened to float32), and
``cpu_batch_step`` runs the step with them.

``decode_logits`` (the model runner's decode-only steps) goes on in the same call from
the token ids' embedding rows through the LM head to the logits, and to each row's greedy
token where that is all a row asks for; ``decoder_step`` stops at the final hidden states
(the model's forward).

It serves models built exactly from ``PreNormDecoderLayer(LlamaAttention, LlamaMLP)``
with plain RMSNorms (Llama, Mistral, Qwen2), float32 activations, linear layers that
keep their weights in panels for one-row inputs (float32, or int8 with per-row scales, as
``cpu_gemv``), and no tensor parallelism. Anything else keeps the torch path, which is
also the reference this is tested against (``tests/test_cpu_decoder_step.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import intrinsic
from torch import nn

from rvllm.kernels import match_torch_threads, numba_cache  # noqa: F401 - stamps the cache
from rvllm.kernels.cpu_decode_attention import _paged_decode, num_splits_for
from rvllm.kernels.cpu_gemv import (
    PANEL,
    ROWS,
    SUMS,
    Panels,
    _group_dots,
    _matvec,
    _panels_into,
    _share,
    _streams,
    embedding_rows,
    embedding_table,
    panel_shape,
)
from rvllm.kernels.cpu_math import exp32, kv_array, narrow_kv
from rvllm.layers.backend import DECODER_STEP_MAX_ROWS


@intrinsic
def _pointer_like(typingctx, address, like):
    """A pointer to ``like``'s element type at an integer address: the layers' weights
    stay where each linear layer keeps them, and the step reaches them through a
    per-layer array of addresses (``_weight``) instead of a stacked copy."""
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))
    return pointer(types.int64, like), codegen


@numba.njit(cache=True, inline="always")
def _weight(addresses, layer, like, rows, cols):
    """The panels of a [rows, cols] weight (``cpu_gemv``) at ``addresses[layer]``."""
    return numba.carray(_pointer_like(addresses[layer], like),
                        ((rows + PANEL - 1) // PANEL, cols, PANEL))


# Decode steps of at most this many sequences run here (float32 weights, int8 weights).
MAX_ROWS, MAX_ROWS_INT8 = DECODER_STEP_MAX_ROWS, 4


@numba.njit(fastmath=True, cache=True, inline="always")
def _silu_put(out, r, g, u, scale, bias, inter):
    """out[r] (one row of the output) = SiLU(g) * u, g from gate row r and u from up row
    r + inter, each with its row's scale and bias."""
    if scale.shape[0] > 0:
        g *= scale[r]
        u *= scale[r + inter]
    if bias.shape[0] > 0:
        g += bias[r]
        u += bias[r + inter]
    out[r] = g / (np.float32(1.0) + exp32(-g)) * u


@numba.njit(fastmath=True, cache=True, inline="always")
def _silu_panel(out, p, t, rows, b0, sums, scale, bias, inter):
    """Rows 16p.. of out[b0 + b] for b < rows: gate and up panel pair t of a pass's sums
    (``cpu_gemv._group_dots``: the gate's at 2t, the up's at 2t + 1)."""
    for b in range(rows):
        for j in range(PANEL):
            _silu_put(out[b0 + b], p * PANEL + j, sums[2 * t * rows + b, j],
                      sums[(2 * t + 1) * rows + b, j], scale, bias, inter)


@numba.njit(parallel=True, fastmath=True, cache=True)
def _gate_up_silu(x, w, scale, bias, out, parts):
    """The merged gate/up projection (rows [0, I) gate, [I, 2I) up; its panels w, I a
    multiple of 16) and SiLU(gate) * up: the [B, 2I] intermediate never exists. Each
    thread takes a share of the gate panels and the up panels beside them, read side by
    side: with one row of x two runs of its share, four streams (gate and up of each),
    else two; ``parts`` as ``cpu_gemv._matvec``'s."""
    inter, batch = out.shape[1], x.shape[0]
    gate_panels = inter // PANEL
    pairs = _streams(batch) // 2
    for part in prange(parts):
        lo, hi = _share(gate_panels, part, parts)
        sums = np.empty((SUMS, PANEL), np.float32)
        run = (hi - lo) // pairs
        for j in range(run):
            for b0 in range(0, batch, ROWS):
                rows = min(ROWS, batch - b0)
                _group_dots(w, lo + j, gate_panels, run, 2 * pairs, x, b0, rows, sums)
                for t in range(pairs):
                    _silu_panel(out, lo + j + t * run, t, rows, b0, sums, scale, bias, inter)
        for p in range(lo + pairs * run, hi):
            for b0 in range(0, batch, ROWS):
                rows = min(ROWS, batch - b0)
                _group_dots(w, p, gate_panels, 0, 2, x, b0, rows, sums)
                _silu_panel(out, p, 0, rows, b0, sums, scale, bias, inter)


@numba.njit(fastmath=True, cache=True)
def _rms_norm(x, weight, eps, out):
    """Each row of x [B, H]."""
    for b in range(x.shape[0]):
        total = np.float32(0.0)
        for i in range(x.shape[1]):
            total += x[b, i] * x[b, i]
        inv = np.float32(1.0) / np.sqrt(total / x.shape[1] + eps)
        for i in range(x.shape[1]):
            out[b, i] = x[b, i] * inv * weight[i]


@numba.njit(fastmath=True, cache=True)
def _rope(x, cos, sin):
    """Rotate-half RoPE in place on one row's heads x [H, D], with its position's cos/sin
    rows [D]."""
    half = x.shape[1] // 2
    for h in range(x.shape[0]):
        for i in range(half):
            a, b = x[h, i], x[h, i + half]
            x[h, i] = a * cos[i] - b * sin[i]
            x[h, i + half] = b * cos[i + half] + a * sin[i + half]


@numba.njit(fastmath=True, cache=True)
def _decoder_step(hidden, norms1, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b, norms2,
                  gu_w, gu_s, gu_b, down_w, down_s, down_b, like, inter, key_cache,
                  value_cache, windows, tables, positions, slots, cos_table, sin_table,
                  num_heads, num_kv_heads, head_dim, scale, eps, final_norm, out, parts):
    """One new token of each of B sequences through every layer. hidden [B, H]: the
    tokens' embeddings, then the residual stream as the layers run. ``*_w``: each
    layer's weight panels of that projection, by address (int64 [L]; element type
    ``like``'s); ``*_s``, ``*_b``: per-row scales (int8) and biases stacked [L, N], or
    [L, 0] for none; norms [L, H]; key_cache / value_cache [L, blocks, block_size, Hk,
    D], float32 or bfloat16 bits (``cpu_math.kv_array``); tables [B, W] each row's cache
    blocks; slots [B] where its K/V go (-1: nowhere); parts: numba's thread count (see
    ``cpu_gemv._matvec``). Writes the final norm of the last residual to ``out`` [B, H]."""
    rows, size = hidden.shape
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv_rows = q_size + 2 * kv_size
    normed = np.empty((rows, size), np.float32)
    delta = np.empty((rows, size), np.float32)
    qkv = np.empty((rows, qkv_rows), np.float32)
    attn = np.empty((rows, num_heads, head_dim), np.float32)
    act = np.empty((rows, inter), np.float32)
    lens, num_splits = positions + 1, num_splits_for(rows, parts)
    block_size = key_cache.shape[2]
    for layer in range(norms1.shape[0]):
        if layer > 0:
            hidden += delta
        _rms_norm(hidden, norms1[layer], eps, normed)
        _matvec(normed, _weight(qkv_w, layer, like, qkv_rows, size), qkv_s[layer],
                qkv_b[layer], qkv, parts)
        q = np.empty((rows, num_heads, head_dim), np.float32)
        for b in range(rows):
            row = qkv[b]
            qb = row[:q_size].reshape((num_heads, head_dim))
            k = row[q_size:q_size + kv_size].reshape((num_kv_heads, head_dim))
            v = row[q_size + kv_size:].reshape((num_kv_heads, head_dim))
            cos, sin = cos_table[positions[b]], sin_table[positions[b]]
            _rope(qb, cos, sin)
            _rope(k, cos, sin)
            for h in range(num_heads):
                for d in range(head_dim):
                    q[b, h, d] = qb[h, d] * scale
            if slots[b] >= 0:
                block, offset = slots[b] // block_size, slots[b] % block_size
                for h in range(num_kv_heads):
                    for d in range(head_dim):
                        key_cache[layer, block, offset, h, d] = narrow_kv(k[h, d], key_cache)
                        value_cache[layer, block, offset, h, d] = narrow_kv(v[h, d],
                                                                            value_cache)
        _paged_decode(q, key_cache[layer], value_cache[layer], tables, lens,
                      np.float32(1.0), windows[layer], np.float32(0.0), num_splits, attn)
        _matvec(attn.reshape((rows, q_size)), _weight(o_w, layer, like, size, q_size),
                o_s[layer], o_b[layer], delta, parts)
        hidden += delta
        _rms_norm(hidden, norms2[layer], eps, normed)
        _gate_up_silu(normed, _weight(gu_w, layer, like, 2 * inter, size), gu_s[layer],
                      gu_b[layer], act, parts)
        _matvec(act, _weight(down_w, layer, like, size, inter), down_s[layer],
                down_b[layer], delta, parts)
    hidden += delta
    _rms_norm(hidden, final_norm, eps, out)


@numba.njit(parallel=True, fastmath=True, cache=True)
def _logits_by_part(x, w, scale, logits, tops, firsts, totals, parts):
    """logits [B, V] = x [B, H] W^T from the LM head's panels w (int8: times its scale);
    then over each thread's share of the vocabulary, while it is in the cache, each row's
    largest logit (tops [parts, B]), the first index holding it (firsts; -1 for an empty
    share) and the sum of exp(logit - largest) (totals)."""
    vocab, batch = logits.shape[1], x.shape[0]
    for part in prange(parts):
        lo, hi = _share(w.shape[0], part, parts)
        _panels_into(x, w, scale, np.empty(0, np.float32), logits, lo, hi,
                     np.empty((SUMS, PANEL), np.float32))
        r0, r1 = lo * PANEL, min(hi * PANEL, vocab)
        for b in range(batch):
            firsts[part, b] = -1
            if r1 <= r0:
                continue
            row = logits[b]
            top = row[r0]
            for i in range(r0, r1):
                top = max(top, row[i])
            for i in range(r0, r1):
                if row[i] == top:
                    firsts[part, b] = i
                    break
            total = np.float32(0.0)
            for i in range(r0, r1):
                total += exp32(row[i] - top)
            tops[part, b], totals[part, b] = top, total


@numba.njit(fastmath=True, cache=True)
def _head_greedy(x, w, scale, logits, token_ids, logprobs, parts):
    """logits [B, V] of the final hidden states x [B, H] through the LM head's panels w,
    and each row's greedy token (the first index of its largest logit, as
    ``torch.argmax``) with its log-softmax logprob (``kernels.cpu_greedy``'s numbers):
    the shares' maxima and sums of ``_logits_by_part``, merged."""
    batch = x.shape[0]
    tops = np.empty((parts, batch), np.float32)
    totals = np.empty((parts, batch), np.float32)
    firsts = np.empty((parts, batch), np.int64)
    _logits_by_part(x, w, scale, logits, tops, firsts, totals, parts)
    for b in range(batch):
        top, best = np.float32(0.0), -1
        for p in range(parts):
            if firsts[p, b] >= 0 and (best < 0 or tops[p, b] > top):
                top, best = tops[p, b], firsts[p, b]
        total = np.float32(0.0)
        for p in range(parts):
            if firsts[p, b] >= 0:
                total += totals[p, b] * exp32(tops[p, b] - top)
        token_ids[b], logprobs[b] = best, -np.log(total)


@numba.njit(fastmath=True, cache=True)
def _step_to_logits(embedding, token_ids, norms1, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b,
                    norms2, gu_w, gu_s, gu_b, down_w, down_s, down_b, like, inter,
                    key_cache, value_cache, windows, tables, positions, slots, cos_table,
                    sin_table, num_heads, num_kv_heads, head_dim, scale, eps, final_norm,
                    head_w, head_s, logits, greedy_ids, greedy_logprobs, parts):
    """``_decoder_step`` from the token ids' rows of the embedding (a table [V / P, H, P],
    ``cpu_gemv.embedding_table``), then the LM head's logits [B, V] (panels head_w, int8
    scales head_s) into ``logits``; with greedy_ids / greedy_logprobs of length B (not
    0), each row's greedy token and its logprob too (``_head_greedy``)."""
    rows, size, per = token_ids.shape[0], embedding.shape[1], embedding.shape[2]
    hidden = np.empty((rows, size), np.float32)
    for b in range(rows):
        hidden[b] = embedding[token_ids[b] // per, :, token_ids[b] % per]
    final = np.empty((rows, size), np.float32)
    _decoder_step(hidden, norms1, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b, norms2, gu_w, gu_s,
                  gu_b, down_w, down_s, down_b, like, inter, key_cache, value_cache,
                  windows, tables, positions, slots, cos_table, sin_table, num_heads,
                  num_kv_heads, head_dim, scale, eps, final_norm, final, parts)
    if greedy_ids.shape[0] > 0:
        _head_greedy(final, head_w, head_s, logits, greedy_ids, greedy_logprobs, parts)
    else:
        _matvec(final, head_w, head_s, np.empty(0, np.float32), logits, parts)


def _linears(modules: list[nn.Module]) -> tuple | None:
    """One projection of every layer: its panels' addresses (int64 [L]), the panels
    themselves (``cpu_gemv.Panels``, kept alive with the plan), their element type as an
    empty array, and the per-row scales (int8) and biases stacked [L, N], or [L, 0] for
    none. None when a layer keeps no panels (``--cpu-linear-backend torch``, fp16
    weights) or the layers differ in format or shape."""
    copies = [getattr(m, "panel_weight", None) for m in modules]
    if any(c is None for c in copies):
        return None
    if len({(c.weight.dtype, c.weight.shape, c.rows, c.scale.shape) for c in copies}) != 1:
        return None
    if not all(c.weight.flags.c_contiguous for c in copies):
        return None
    addresses = np.array([c.weight.ctypes.data for c in copies], dtype=np.int64)
    rows = copies[0].rows
    scale = (np.stack([c.scale for c in copies]) if copies[0].scale.shape[0] > 0
             else np.empty((len(copies), 0), np.float32))
    biases = [getattr(m, "bias", None) for m in modules]
    if any(b is None for b in biases):
        bias = np.empty((len(modules), 0), np.float32)
    else:
        bias = torch.stack([b.detach().float() for b in biases]).numpy()
    assert bias.shape[1] in (0, rows) and scale.shape[1] in (0, rows)
    return addresses, copies, np.empty(0, copies[0].weight.dtype), scale, bias


class DecoderStepPlan:
    """Everything ``_decoder_step`` reads for one model, gathered once: the weights'
    addresses (the weights themselves stay with their linear layers; the plan keeps them
    alive too), the small per-layer arrays stacked over the layers, the rotary tables.
    The KV caches are looked up when the engine has allocated them."""

    def __init__(self, layers: list[nn.Module], attrs: dict[str, Any]) -> None:
        self.layers = layers
        self.__dict__.update(attrs)
        self._caches: tuple[tuple, tuple[np.ndarray, np.ndarray] | None] | None = None
        self._head: tuple[nn.Module, Panels | None] | None = None
        self._logits: np.ndarray | None = None  # [max_rows, V], reused step after step

    def caches(self) -> tuple[np.ndarray, np.ndarray] | None:
        """[L, blocks, block_size, Hk, D] keys and values, when every layer's cache is a
        slice of one allocation (``ModelRunner.allocate_kv_cache``); else None. Checked
        again only when the first layer's cache moves or changes shape."""
        first = self.layers[0].self_attn.attn.kv_cache
        if first is None:
            return None
        key = (first[0].data_ptr(), first[1].data_ptr(), tuple(first[0].shape))
        if self._caches is None or self._caches[0] != key:
            self._caches = (key, self._stacked_caches())
        return self._caches[1]

    def head(self, lm_head: nn.Module) -> Panels | None:
        """The LM head's panels when ``decode_logits`` can compute its logits: a plain
        ``ParallelLMHead`` on one rank, no bias, panels of this stack's weight format and
        hidden size (checked once)."""
        if self._head is None or self._head[0] is not lm_head:
            from rvllm.layers.embedding import ParallelLMHead

            panels = getattr(lm_head, "panel_weight", None)
            ok = (type(lm_head) is ParallelLMHead and panels is not None
                  and lm_head.bias is None and lm_head.tp_size == 1
                  and panels.rows == lm_head.num_embeddings
                  and panels.weight.shape[1] == self.final_norm.shape[0]
                  and panels.weight.dtype == self.like.dtype)
            self._head = (lm_head, panels if ok else None)
        return self._head[1]

    def _stacked_caches(self) -> tuple[np.ndarray, np.ndarray] | None:
        stacked = []
        for which in (0, 1):
            base = self.layers[0].self_attn.attn.kv_cache[which]._base
            if base is None or base.dim() != 5 or base.shape[0] != len(self.layers):
                return None
            if any(layer.self_attn.attn.kv_cache[which].data_ptr() != base[i].data_ptr()
                   for i, layer in enumerate(self.layers)):
                return None
            stacked.append(kv_array(base))
        return stacked[0], stacked[1]


def build_plan(decoder: nn.Module) -> DecoderStepPlan | None:
    """The plan for ``decoder`` (a ``DecoderModel``), or None when its layers are not
    exactly the Llama shape this kernel computes or its linear layers keep no weight
    panels."""
    from rvllm.distributed import get_tp_size
    from rvllm.layers.norm import RMSNorm
    from rvllm.layers.rotary import RotaryEmbedding
    from rvllm.models.base import PreNormDecoderLayer
    from rvllm.models.llama import LlamaAttention, LlamaMLP

    layers = list(decoder.layers)
    if (get_tp_size() != 1 or type(decoder.norm) is not RMSNorm or not layers
            or decoder.embed_tokens.weight.dtype != torch.float32):
        return None
    first = layers[0]
    for layer in layers:
        if (type(layer) is not PreNormDecoderLayer or type(layer.self_attn) is not LlamaAttention
                or type(layer.mlp) is not LlamaMLP
                or type(layer.input_layernorm) is not RMSNorm
                or type(layer.post_attention_layernorm) is not RMSNorm
                or type(layer.self_attn.rotary_emb) is not RotaryEmbedding):
            return None
        attn = layer.self_attn.attn
        if (attn.logits_soft_cap is not None or attn.scale != first.self_attn.attn.scale
                or layer.input_layernorm.eps != decoder.norm.eps
                or layer.post_attention_layernorm.eps != decoder.norm.eps
                or layer.self_attn.rotary_emb.cos_cache.data_ptr()
                != first.self_attn.rotary_emb.cos_cache.data_ptr()):
            return None
    attrs: dict[str, Any] = {"weights": []}
    likes = set()
    for name, get in (("qkv", lambda layer: layer.self_attn.qkv_proj),
                      ("o", lambda layer: layer.self_attn.o_proj),
                      ("gu", lambda layer: layer.mlp.gate_up_proj),
                      ("down", lambda layer: layer.mlp.down_proj)):
        found = _linears([get(layer) for layer in layers])
        if found is None:
            return None
        addresses, weights, like, attrs[f"{name}_s"], attrs[f"{name}_b"] = found
        attrs[f"{name}_w"] = addresses
        attrs["weights"].append(weights)
        attrs["like"] = like
        likes.add(like.dtype)
    if len(likes) != 1:
        return None  # one weight format for the whole stack

    attn0, rotary = first.self_attn, first.self_attn.rotary_emb
    num_heads, num_kv_heads, head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    hidden = decoder.norm.weight.shape[0]
    inter = first.mlp.gate_up_proj.panel_weight.rows // 2
    if inter % PANEL:
        return None  # the fused gate/up takes whole panels of each
    q_size = num_heads * head_dim
    # The kernel reads each weight by address at these shapes: they must be exact.
    expected = {"qkv": (q_size + 2 * num_kv_heads * head_dim, hidden), "o": (hidden, q_size),
                "gu": (2 * inter, hidden), "down": (hidden, inter)}
    if any((panel.rows, panel.weight.shape[1]) != shape
           for panel, shape in zip((w[0] for w in attrs["weights"]), expected.values())):
        return None
    attrs.update({
        "norms1": torch.stack([layer.input_layernorm.weight.detach() for layer in layers])
        .numpy(),
        "norms2": torch.stack([layer.post_attention_layernorm.weight.detach()
                               for layer in layers]).numpy(),
        "windows": np.array([layer.self_attn.attn.sliding_window or 0 for layer in layers],
                            dtype=np.int64),
        "cos": rotary.cos_cache.numpy(), "sin": rotary.sin_cache.numpy(),
        "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
        "scale": np.float32(attn0.attn.scale), "eps": np.float32(decoder.norm.eps),
        "final_norm": decoder.norm.weight.detach().numpy(),
        "embedding": embedding_table(decoder.embed_tokens.weight),
        "max_rows": MAX_ROWS_INT8 if attrs["like"].dtype == np.int8 else MAX_ROWS,
        "inter": inter,
    })
    return DecoderStepPlan(layers, attrs)


def _layer_args(plan: DecoderStepPlan, caches: tuple[np.ndarray, np.ndarray],
                block_tables: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> tuple:
    """``_decoder_step``'s arguments from ``norms1`` to ``final_norm``, as both of its
    callers pass them."""
    return (plan.norms1, plan.qkv_w, plan.qkv_s, plan.qkv_b, plan.o_w, plan.o_s, plan.o_b,
            plan.norms2, plan.gu_w, plan.gu_s, plan.gu_b, plan.down_w, plan.down_s,
            plan.down_b, plan.like, plan.inter, *caches, plan.windows, block_tables,
            positions, slots, plan.cos, plan.sin, plan.num_heads, plan.num_kv_heads,
            plan.head_dim, plan.scale, plan.eps, plan.final_norm)


def decoder_step(plan: DecoderStepPlan, token_ids: torch.Tensor, positions: np.ndarray,
                 slots: np.ndarray, block_tables: np.ndarray) -> torch.Tensor | None:
    """Final hidden states [B, H] of one new token of each of B sequences: token ids [B],
    their positions and cache slots (int64 [B]; slot -1: not written), and each
    sequence's cache blocks (int64 [B, W]). None when the KV caches are not one stacked
    allocation (the layers then run the step)."""
    caches = plan.caches()
    if caches is None or token_ids.shape[0] > plan.max_rows:
        return None
    match_torch_threads()
    hidden = embedding_rows(plan.embedding, token_ids).numpy()  # a copy: the residual stream
    out = torch.empty(hidden.shape, dtype=torch.float32)
    _decoder_step(hidden, *_layer_args(plan, caches, block_tables, positions, slots),
                  out.numpy(), numba.get_num_threads())
    return out


@dataclass(slots=True)
class DecodeLogits:
    """What ``decode_logits`` returns."""

    logits: torch.Tensor  # [B, V] float32: a view of a buffer the next step writes over
    greedy: tuple[list[int], list[float]] | None  # each row's argmax and its logprob


def decode_logits(plan: DecoderStepPlan, lm_head: nn.Module, token_ids: np.ndarray,
                  positions: np.ndarray, slots: np.ndarray, block_tables: np.ndarray,
                  greedy: bool) -> DecodeLogits | None:
    """A decode step of B sequences (arguments as ``decoder_step``'s, token ids int64
    [B]) from the token ids through the layers and the LM head in one compiled call: the
    logits, and with ``greedy`` each row's argmax token and its logprob, found by the
    threads that computed the logits. None when this path does not cover the step (the
    caller takes the general one).

    After a step has streamed the weights through the caches, every line of Python runs
    on code and data fetched from memory again: at N=1 the two calls and tensors of
    ``decoder_step`` plus ``compute_logits`` and the sampler's pass cost 0.5-0.8 ms of
    a 9 ms step (the random Llama, 2-core Zen 5); here what is left of them is the call."""
    caches, head = plan.caches(), plan.head(lm_head)
    rows = token_ids.shape[0]
    if caches is None or head is None or rows > plan.max_rows:
        return None
    if plan._logits is None:
        plan._logits = np.empty((plan.max_rows, head.rows), np.float32)
    logits = plan._logits[:rows]
    ids, logprobs = np.empty(rows if greedy else 0, np.int64), np.empty(rows, np.float32)
    match_torch_threads()
    _step_to_logits(plan.embedding.numpy(), token_ids,
                    *_layer_args(plan, caches, block_tables, positions, slots), head.weight,
                    head.scale, logits, ids, logprobs, numba.get_num_threads())
    return DecodeLogits(torch.from_numpy(logits),
                        (ids.tolist(), logprobs.tolist()) if greedy else None)


def warm_up(kv_dtype: torch.dtype = torch.float32, int8: bool = True) -> None:
    """Compile (or load from numba's cache) the step for float32 weights (and int8 ones
    when ``int8``) on a one-layer toy stack with a cache of ``kv_dtype``, so a model's
    first decode step does not pay for it."""
    heads, kv_heads, dim, hidden, inter = 2, 1, 4, 8, 16
    kept = []  # the toy weights stay alive while the step reads them by address
    for dtype in (np.float32, np.int8) if int8 else (np.float32,):
        def linear(rows: int, cols: int, dtype: type = dtype, kept: list = kept) -> tuple:
            weight = np.zeros(panel_shape(rows, cols), dtype)
            kept.append(weight)
            scale = np.ones((1, rows if dtype is np.int8 else 0), np.float32)
            return (np.array([weight.ctypes.data], np.int64), scale,
                    np.empty((1, 0), np.float32))

        ones = np.ones((1, hidden), np.float32)
        cache = kv_array(torch.zeros((1, 1, 4, kv_heads, dim), dtype=kv_dtype))
        rope = np.ones((4, dim), np.float32)
        zeros = np.zeros(1, np.int64)
        layers = (ones, *linear((heads + 2 * kv_heads) * dim, hidden),
                  *linear(hidden, heads * dim), ones, *linear(2 * inter, hidden),
                  *linear(hidden, inter), np.empty(0, dtype), inter, cache, cache,
                  zeros, np.zeros((1, 1), np.int64), zeros, zeros, rope, rope, heads,
                  kv_heads, dim, np.float32(1.0), np.float32(1e-6),
                  np.ones(hidden, np.float32))
        _decoder_step(np.zeros((1, hidden), np.float32), *layers,
                      np.empty((1, hidden), np.float32), numba.get_num_threads())
        head = np.zeros(panel_shape(20, hidden), dtype)
        scale = np.ones(20 if dtype is np.int8 else 0, np.float32)
        _step_to_logits(np.zeros((20, hidden, 1), np.float32), zeros, *layers, head, scale,
                        np.empty((1, 20), np.float32), np.empty(1, np.int64),
                        np.empty(1, np.float32), numba.get_num_threads())
