"""Llama, and the architectures shaped like it: Mistral (sliding window) and Qwen2 (q/k/v bias,
sliding windows from ``max_window_layers`` on)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rvllm.distributed import get_tp_size
from rvllm.forward_context import get_forward_context
from rvllm.layers.activation import SiluAndMul
from rvllm.layers.attention import Attention
from rvllm.layers.backend import fused_decode_gemv_rows, use_numba
from rvllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rvllm.layers.norm import RMSNorm
from rvllm.layers.rotary import RotaryEmbedding, rope_parameters
from rvllm.lora.layers import lora_active
from rvllm.models.base import CausalLM, DecoderModel, PreNormDecoderLayer, layer_types

if TYPE_CHECKING:
    import numpy as np

    from rvllm.kernels.cpu.decoder_step import DecodeLogits
    from rvllm.models.cpu_step import CpuStepPlan


def qwen_layer_types(cfg: dict[str, Any]) -> list[str]:
    """Qwen2/Qwen3 slide only under ``use_sliding_window``, and then (unless
    ``layer_types`` says otherwise) on the layers from ``max_window_layers`` on; a config
    that leaves it off may still name a window (Qwen2.5's 131072), which never applies."""
    n = cfg["num_hidden_layers"]
    if not (cfg.get("use_sliding_window", False) and cfg.get("sliding_window")):
        return ["full_attention"] * n
    if cfg.get("layer_types"):
        return layer_types(cfg)
    first = cfg.get("max_window_layers", 28)  # transformers' default
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


def layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Each layer's window: Mistral's (and Mixtral's) ``sliding_window`` is every layer's,
    Qwen2's per ``qwen_layer_types``."""
    window = cfg.get("sliding_window")
    if cfg.get("model_type") == "qwen2":
        return [int(window) if t == "sliding_attention" else None
                for t in qwen_layer_types(cfg)]
    return [int(window) if window else None] * cfg["num_hidden_layers"]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int,
                 window: int | None = None) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = cfg.get("head_dim") or hidden // num_heads
        bias = bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2"
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=bias)
        # Qwen2 has q/k/v biases but none on o_proj; Llama's attention_bias covers all four.
        o_bias = bool(cfg.get("attention_bias", False)) and cfg.get("model_type") != "qwen2"
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.rotary_emb = RotaryEmbedding(head_dim, max_position, rope_parameters(cfg))
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5,
                              sliding_window=window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention and the output projection, from the QKV projection's output."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # RoPE is applied inside attention, where the Triton path fuses it with the
        # KV-cache write.
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported for Llama-style MLPs (silu).")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate],
                                                       bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderModel(DecoderModel):
    """The decoder stack of Llama layers. Under the CPU's numba kernels, a step runs as
    compiled calls through every layer (``models.cpu_step``) where the stack is exactly
    the shape they compute."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if lora_active():  # adapters are added in the linear layers' forward
            return super().forward(input_ids, positions)
        if use_numba():
            hidden = self._compiled_step(input_ids, positions)
            if hidden is not None:
                return hidden
        elif input_ids.shape[0] <= fused_decode_gemv_rows() and self.fuses_decode_gemv():
            return self._fused_gemv_forward(input_ids, positions)
        return super().forward(input_ids, positions)

    def fuses_decode_gemv(self) -> bool:
        """Whether steps of a few tokens may run the fused GEMVs (``--fused-decode-gemv``):
        Llama-shaped layers whose QKV, gate/up and down projections are plain weights
        (not int4 or fp8) on one tensor-parallel rank. Decided once, after load."""
        fuses = self.__dict__.get("_fuses_decode_gemv")
        if fuses is None:
            fuses = get_tp_size() == 1 and self._llama_shaped() and all(
                getattr(linear, "linear_kind", None) is None and linear.weight.stride(-1) == 1
                for layer in self.layers
                for linear in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj,
                               layer.mlp.down_proj))
            self.__dict__["_fuses_decode_gemv"] = fuses
        return fuses

    def _fused_gemv_forward(self, input_ids: torch.Tensor, positions: torch.Tensor
                            ) -> torch.Tensor:
        """The layers with each norm folded into the projection after it, and SiLU * mul
        into the down projection (``kernels.triton.fused_gemv``)."""
        from rvllm.kernels.triton.fused_gemv import norm_gemv, silu_mul_gemv

        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norm = layer.input_layernorm
            qkv, residual = norm_gemv(x, residual, norm.weight, norm.eps,
                                      attn.qkv_proj.weight, attn.qkv_proj.bias)
            x = attn.attend(positions, qkv)
            norm = layer.post_attention_layernorm
            gate_up, residual = norm_gemv(x, residual, norm.weight, norm.eps,
                                          mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
            x = silu_mul_gemv(gate_up, mlp.down_proj.weight, mlp.down_proj.bias)
        x, _ = self.norm(x, residual)
        return x

    def step_plan(self) -> CpuStepPlan | None:
        """The compiled steps' plan for these layers (``models.cpu_step.build_plan``, made
        once), or None where they do not cover them."""
        plan = self.__dict__.get("_decoder_step_plan", False)
        if plan is False:
            from rvllm.models.cpu_step import build_plan

            plan = build_plan(self) if self._kernels_compute_it() else None
            self.__dict__["_decoder_step_plan"] = plan
        return plan

    def _llama_shaped(self) -> bool:
        """Every layer exactly Llama's: no subclass, plain RMSNorms, a SiLU-gated MLP."""
        return type(self.norm) is RMSNorm and len(self.layers) > 0 and all(
            type(layer) is PreNormDecoderLayer and type(layer.self_attn) is LlamaAttention
            and type(layer.mlp) is LlamaMLP and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm
            for layer in self.layers)

    def _kernels_compute_it(self) -> bool:
        """Whether the layers are exactly the Llama shape the CPU's whole-step kernels
        compute: no subclass, plain RMSNorms of one epsilon, one attention scale and
        rotary table, no soft-capping, float32, one tensor-parallel rank."""
        layers = list(self.layers)
        if (get_tp_size() != 1 or not self._llama_shaped()
                or self.embed_tokens.weight.dtype != torch.float32):
            return False
        first = layers[0].self_attn
        for layer in layers:
            attn = layer.self_attn
            if type(attn.rotary_emb) is not RotaryEmbedding:
                return False
            if (attn.attn.logits_soft_cap is not None or attn.attn.scale != first.attn.scale
                    or layer.input_layernorm.eps != self.norm.eps
                    or layer.post_attention_layernorm.eps != self.norm.eps
                    or attn.rotary_emb.cos_cache.data_ptr()
                    != first.rotary_emb.cos_cache.data_ptr()):
                return False
        return True

    def _compiled_step(self, input_ids: torch.Tensor, positions: torch.Tensor
                       ) -> torch.Tensor | None:
        """A decode step of a few sequences as one compiled call through every layer, any
        other step as the layers' GEMMs with numba kernels between them; None leaves it
        to the layers."""
        from rvllm.models import cpu_step

        ctx = get_forward_context()
        plan = self.step_plan()
        if plan is None:
            return None
        positions_np, slots = positions.numpy(), ctx.slot_mapping.numpy()
        if (not ctx.prefills and ctx.num_decode_tokens == input_ids.shape[0] <= plan.max_rows
                and ctx.decode_block_tables is not None):
            return cpu_step.decode_hidden(plan, input_ids, positions_np, slots,
                                          ctx.decode_block_tables.numpy())
        return cpu_step.batch_step(plan, input_ids, positions_np, slots, ctx)


class LlamaForCausalLM(CausalLM):
    """Pre-norm decoder layers of Llama attention and a SiLU-gated MLP under an LM head."""

    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        layers = [
            PreNormDecoderLayer(cfg, LlamaAttention(cfg, max_position, window),
                                LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"],
                                         cfg.get("hidden_act", "silu"),
                                         bool(cfg.get("mlp_bias", False))))
            for window in layer_windows(cfg)
        ]
        super().__init__(cfg, LlamaDecoderModel(cfg, layers))

    def decode_logits(self, token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                      block_tables: np.ndarray, greedy: bool) -> DecodeLogits | None:
        plan = self._step_plan()
        if plan is None:
            return None
        from rvllm.models.cpu_step import decode_logits

        return decode_logits(plan, self.lm_head, token_ids, positions, slots, block_tables,
                             greedy)

    def decode_greedy_steps(self, token_ids: np.ndarray, positions: np.ndarray,
                            block_tables: np.ndarray, block_size: int, num_steps: int,
                            stops: np.ndarray) -> tuple[list[list[int]], list[list[float]]] | None:
        plan = self._step_plan()
        if plan is None:
            return None
        from rvllm.models.cpu_step import decode_greedy_steps

        return decode_greedy_steps(plan, self.lm_head, token_ids, positions, block_tables,
                                   block_size, num_steps, stops)

    def _step_plan(self) -> CpuStepPlan | None:
        """The compiled CPU step's plan, where it computes exactly this model."""
        if (not use_numba() or type(self).forward is not CausalLM.forward
                or type(self).compute_logits is not CausalLM.compute_logits
                or type(self.model) is not LlamaDecoderModel):
            return None
        return self.model.step_plan()
