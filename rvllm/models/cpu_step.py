"""The model's side of the CPU's whole-step kernels (``kernels/cpu/decoder_step.py``,
``decode_steps.py``, ``batch_step.py``): which stacks they compute exactly, the plan of
arrays and weight addresses they read (built once from the layers), the KV caches and
the LM head's panels, looked up as the engine allocates them, and the batch step's loop
over the layers.

The kernels compute a Llama-shaped stack: pre-norm layers of Llama attention and a
SiLU-gated MLP with plain RMSNorms (Llama, Mistral, Qwen2; ``LlamaDecoderModel`` checks
its layers are exactly that), float32 activations, linear layers that keep their
weights in panels (float32, or int8 with per-row scales), and no tensor parallelism.
Anything else keeps the layers' path, which is also the reference the kernels are
tested against (``tests/test_cpu_decoder_step.py``). This module reads the layers by
their attributes and imports no model.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import nn

from rvllm.forward_context import AttentionMetadata
from rvllm.kernels.cpu import batch_step as batch_kernels
from rvllm.kernels.cpu import decode_steps, decoder_step
from rvllm.kernels.cpu.decode_attention import step_arrays
from rvllm.kernels.cpu.decoder_step import DecodeLogits, DecoderStepPlan
from rvllm.kernels.cpu.gemv import Panels, embedding_rows
from rvllm.kernels.cpu.threads import match_torch_threads
from rvllm.layers.cpu_linear import matmul_unbiased
from rvllm.layers.embedding import ParallelLMHead

_PROJECTIONS = {"qkv": lambda layer: layer.self_attn.qkv_proj,
                "o": lambda layer: layer.self_attn.o_proj,
                "gu": lambda layer: layer.mlp.gate_up_proj,
                "down": lambda layer: layer.mlp.down_proj}


class CpuStepPlan:
    """A model's plan for the compiled steps: the kernels' arrays (``arrays``), the layers
    they were gathered from, and what is looked up once the engine has allocated it (the
    stacked KV caches, the LM head's panels, a logits buffer)."""

    def __init__(self, layers: list[nn.Module], arrays: DecoderStepPlan) -> None:
        self.layers = layers
        self.arrays = arrays
        self.max_rows = arrays.max_rows
        # The first layer's attention: its cache, looked up every step, is a plain
        # attribute (not a submodule's, as the layers' path to it is: 3-5 us cold).
        self._first_attention = layers[0].self_attn.attn
        self._caches: tuple[tuple, tuple[np.ndarray, np.ndarray] | None] | None = None
        self._head: tuple[nn.Module, Panels | None] | None = None
        self._logits: np.ndarray | None = None  # [max_rows, V], reused step after step
        self._batch_ok: bool | None = None

    def caches(self) -> tuple[np.ndarray, np.ndarray] | None:
        """[L, blocks, block_size, Hk, D] keys and values, when every layer's cache is a
        slice of one allocation (``ModelRunner.allocate_kv_cache``); else None. Checked
        again only when the first layer's cache is another (tuple of tensors)."""
        first = self._first_attention.kv_cache  # a tuple that each allocation makes anew
        if first is None:
            return None
        if self._caches is None or self._caches[0] is not first:
            layer_caches = [layer.self_attn.attn.kv_cache for layer in self.layers]
            self._caches = (first, decoder_step.stacked_caches(layer_caches)
                            or _first_of_deeper_stack(layer_caches))
        return self._caches[1]

    def head(self, lm_head: nn.Module) -> Panels | None:
        """The LM head's panels when the compiled step can go on to its logits: a plain
        ``ParallelLMHead`` on one rank, no bias, panels of this stack's weight format and
        hidden size (checked once)."""
        if self._head is None or self._head[0] is not lm_head:
            panels = getattr(lm_head, "panel_weight", None)
            ok = (type(lm_head) is ParallelLMHead and panels is not None
                  and lm_head.bias is None and lm_head.tp_size == 1
                  and panels.rows == lm_head.num_embeddings
                  and decoder_step.head_fits(self.arrays, panels))
            self._head = (lm_head, panels if ok else None)
        return self._head[1]

    def logits_call_parts(self, lm_head: nn.Module, rows: int
                          ) -> tuple[tuple[np.ndarray, np.ndarray], Panels, np.ndarray] | None:
        """What a compiled call of ``rows`` rows through to the logits needs beside the
        plan: the stacked KV caches, the LM head's panels, and a logits buffer [rows, V]
        that each call writes over. None where such a call cannot run."""
        caches, head = self.caches(), self.head(lm_head)
        if caches is None or head is None or rows > self.max_rows:
            return None
        if self._logits is None:
            self._logits = np.empty((self.max_rows, head.rows), np.float32)
        return caches, head, self._logits[:rows]

    def batch_ok(self) -> bool:
        """Whether every linear layer of the stack is packed for oneDNN or int8, all in
        one of the two (what ``batch_step`` computes)."""
        if self._batch_ok is None:
            kinds = {getattr(get(layer), "linear_kind", None) for layer in self.layers
                     for get in _PROJECTIONS.values()}
            self._batch_ok = kinds in ({"int8"}, {"onednn"}, {"packed"})
        return self._batch_ok


def _first_of_deeper_stack(layer_caches: list[tuple[torch.Tensor, torch.Tensor]]
                           ) -> tuple[np.ndarray, np.ndarray] | None:
    """The stacked caches of layers that are the first few of a deeper stack's one
    allocation (a self-draft's: ``spec_decode.draft.self_draft_model``), else None."""
    keys, values = layer_caches[0][0]._base, layer_caches[0][1]._base
    n = len(layer_caches)
    if keys is None or values is None or keys.dim() != 5 or keys.shape[0] <= n:
        return None
    whole = layer_caches + [(keys[i], values[i]) for i in range(n, keys.shape[0])]
    stacked = decoder_step.stacked_caches(whole)
    return None if stacked is None else (stacked[0][:n], stacked[1][:n])


def build_plan(decoder: nn.Module) -> CpuStepPlan | None:
    """The plan for ``decoder``, a stack of Llama layers (embed_tokens, layers[i] with
    self_attn.{qkv_proj, o_proj, rotary_emb, attn}, mlp.{gate_up_proj, down_proj} and
    two norms, norm) that the caller has checked are exactly the shape the kernels
    compute, or None when its linear layers keep no weight panels
    (``--cpu-linear-backend torch``, fp16 weights) or the kernels cannot take them."""
    layers = list(decoder.layers)
    projections = {}
    for name, get in _PROJECTIONS.items():
        modules = [get(layer) for layer in layers]
        panels = [getattr(m, "panel_weight", None) for m in modules]
        if any(p is None for p in panels):
            return None
        projections[name] = decoder_step.stack_linears(
            panels, [getattr(m, "bias", None) for m in modules])
        if projections[name] is None:
            return None
    attn0, rotary = layers[0].self_attn, layers[0].self_attn.rotary_emb
    arrays = decoder_step.make_plan(
        projections,
        norms1=torch.stack([layer.input_layernorm.weight.detach() for layer in layers]).numpy(),
        norms2=torch.stack([layer.post_attention_layernorm.weight.detach()
                            for layer in layers]).numpy(),
        windows=np.array([layer.self_attn.attn.sliding_window or 0 for layer in layers],
                         dtype=np.int64),
        cos=rotary.cos_cache.numpy(), sin=rotary.sin_cache.numpy(),
        num_heads=attn0.num_heads, num_kv_heads=attn0.num_kv_heads, head_dim=attn0.head_dim,
        scale=attn0.attn.scale, eps=decoder.norm.eps,
        final_norm=decoder.norm.weight.detach().numpy(),
        embedding_weight=decoder.embed_tokens.weight)
    return None if arrays is None else CpuStepPlan(layers, arrays)


def decode_hidden(plan: CpuStepPlan, token_ids: torch.Tensor, positions: np.ndarray,
                  slots: np.ndarray, block_tables: np.ndarray) -> torch.Tensor | None:
    """Final hidden states [B, H] of a decode step of B sequences in one compiled call
    (``kernels.cpu.decoder_step.decoder_step``), or None when the KV caches are not one
    stacked allocation or B is past the kernel's rows (the layers then run the step)."""
    caches = plan.caches()
    if caches is None or token_ids.shape[0] > plan.max_rows:
        return None
    return decoder_step.decoder_step(plan.arrays, caches, token_ids, positions, slots,
                                     block_tables)


def decode_logits(plan: CpuStepPlan, lm_head: nn.Module, token_ids: np.ndarray,
                  positions: np.ndarray, slots: np.ndarray, block_tables: np.ndarray,
                  greedy: bool) -> DecodeLogits | None:
    """A decode step from the token ids through the LM head in one compiled call
    (``kernels.cpu.decoder_step.decode_logits``), or None where it does not cover the
    step (the caller takes the general one)."""
    parts = plan.logits_call_parts(lm_head, token_ids.shape[0])
    if parts is None:
        return None
    caches, head, logits = parts
    return decoder_step.decode_logits(plan.arrays, caches, head, logits, token_ids,
                                      positions, slots, block_tables, greedy)


def decode_greedy_steps(plan: CpuStepPlan, lm_head: nn.Module, token_ids: np.ndarray,
                        positions: np.ndarray, block_tables: np.ndarray, block_size: int,
                        num_steps: int, stops: np.ndarray
                        ) -> tuple[list[list[int]], list[list[float]]] | None:
    """Up to ``num_steps`` greedy decode steps in one compiled call
    (``kernels.cpu.decode_steps``), or None where ``decode_logits`` would not cover the
    step."""
    parts = plan.logits_call_parts(lm_head, token_ids.shape[0])
    if parts is None:
        return None
    caches, head, logits = parts
    return decode_steps.decode_greedy_steps(plan.arrays, caches, head, logits, token_ids,
                                            positions, block_tables, block_size, num_steps,
                                            stops)


def batch_step(plan: CpuStepPlan, token_ids: torch.Tensor, positions: np.ndarray,
               slots: np.ndarray, ctx: AttentionMetadata) -> torch.Tensor | None:
    """Final hidden states [T, H] of a step's T new tokens (token ids, their positions and
    cache slots, int64; ``ctx``: the step's attention metadata, decodes first): the
    layers' GEMMs with the numba kernels of ``kernels.cpu.batch_step`` between them. None
    when the KV caches are not one stacked allocation, the linear layers are not all
    packed for oneDNN or int8, or the decodes come without block tables. Prefill chunks
    attend through their layer's attention (``Attention.prefill_chunk``)."""
    caches = plan.caches()
    if (caches is None or not plan.batch_ok()
            or (ctx.num_decode_tokens and ctx.decode_block_tables is None)):
        return None
    match_torch_threads()
    threads = np.int64(numba.get_num_threads())
    arrays = plan.arrays
    rows = token_ids.shape[0]
    quantize = arrays.like.dtype == np.int8
    hidden_t = embedding_rows(arrays.embedding, token_ids)  # a copy: the residual stream
    hidden = hidden_t.numpy()
    normed_t = torch.empty_like(hidden_t)
    normed = normed_t.numpy()
    attn_t = torch.empty(rows, arrays.num_heads * arrays.head_dim)
    act_t = torch.empty(rows, arrays.inter)
    q_t = torch.empty(rows, arrays.num_heads, arrays.head_dim)
    in_scales = np.empty(rows if quantize else 0, np.float32)
    mid_scales = np.empty(rows if quantize else 0, np.float32)
    none = np.empty(0, np.float32)
    if ctx.num_decode_tokens:
        tables, lens, num_splits = step_arrays(ctx.decode_block_tables, ctx.decode_seq_lens)
    else:
        tables, lens, num_splits = np.empty((0, 1), np.int64), np.empty(0, np.int64), 1
    prefills = ctx.prefills
    key_caches, value_caches = caches
    delta, delta_scale, delta_bias = np.empty((0, hidden.shape[1]), np.float32), none, none
    for i, layer in enumerate(plan.layers):
        attn, mlp = layer.self_attn, layer.mlp
        batch_kernels.add_norm(hidden, delta, delta_scale, delta_bias, arrays.norms1[i],
                               arrays.eps, normed, in_scales, quantize)
        qkv = matmul_unbiased(attn.qkv_proj, normed_t, threads)
        batch_kernels.qkv_attention(
            qkv.numpy(), in_scales, arrays.qkv_b[i], arrays.cos, arrays.sin, positions, slots,
            key_caches[i], value_caches[i], tables, lens, arrays.windows[i], arrays.scale,
            np.int64(num_splits), threads, q_t.numpy(), attn_t.numpy(), mid_scales,
            quantize and not prefills)
        if prefills:
            _prefill_attention(attn.attn, prefills, q_t, qkv, attn_t)
            batch_kernels.scale_rows(attn_t.numpy(), mid_scales, quantize)
        o = matmul_unbiased(attn.o_proj, attn_t, threads)
        batch_kernels.add_norm(hidden, o.numpy(), mid_scales, arrays.o_b[i], arrays.norms2[i],
                               arrays.eps, normed, in_scales, quantize)
        gate_up = matmul_unbiased(mlp.gate_up_proj, normed_t, threads)
        batch_kernels.silu_mul(gate_up.numpy(), in_scales, arrays.gu_b[i], act_t.numpy(),
                               mid_scales, quantize)
        delta = matmul_unbiased(mlp.down_proj, act_t, threads).numpy()
        delta_scale, delta_bias = mid_scales, arrays.down_b[i]
    out = torch.empty_like(hidden_t)
    batch_kernels.add_norm(hidden, delta, delta_scale, delta_bias, arrays.final_norm,
                           arrays.eps, out.numpy(), none, False)
    return out


def _prefill_attention(module: nn.Module, prefills: list, q: torch.Tensor,
                       qkv: torch.Tensor, out: torch.Tensor) -> None:
    """Each prefill chunk's attention, as ``layers.attention.Attention`` computes it: over
    the chunk's own (rotated) keys and values when those are all it sees, else over its
    context gathered from the cache (which ``qkv_attention`` has just written)."""
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
