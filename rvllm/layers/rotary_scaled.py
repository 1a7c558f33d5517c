"""RoPE over part of each head, with the scalings `rotary.py` does not know: Phi-3's
LongRoPE and DeepSeek's YaRN, both of which also scale cos/sin by an attention factor,
and Gemma 4's proportional RoPE, which rotates only the fastest pairs of the whole head.

Some checkpoints (DeepSeek-V2) rotate interleaved pairs (x0, x1), (x2, x3), ... rather than
the two halves of the rotated features; ``interleaved`` picks that layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rvllm.layers.rotary import SUPPORTED_ROPE_TYPES, _inv_freq

SCALED_ROPE_TYPES = ("longrope", "yarn", "proportional")


def rope_type_of(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a config (either spelling), validated against every type known."""
    params = dict(hf_config.get("rope_scaling") or {})
    params.update(hf_config.get("rope_parameters") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    if "original_max_position_embeddings" in hf_config:  # Phi-3 keeps it at the top level
        params.setdefault("original_max_position_embeddings",
                          hf_config["original_max_position_embeddings"])
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = "longrope" if rope_type == "su" else rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES + SCALED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES + SCALED_ROPE_TYPES)}.")
    params["rope_type"] = rope_type
    return params


def _longrope(dim: int, params: dict[str, Any], max_position: int, model_max: int
              ) -> tuple[torch.Tensor, float]:
    # As llama.cpp does, the long factors are used whenever the engine may run past the
    # pretraining length, so a sequence's keys never mix the two sets.
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or model_max / original
    scale = params.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = params["long_factor"] if max_position > original else params["short_factor"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = float(params["rope_theta"])
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**exponents), float(scale)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, params: dict[str, Any], model_max: int) -> tuple[torch.Tensor, float]:
    # Low-frequency features are interpolated by `factor`, high-frequency ones kept, with
    # a linear ramp between the correction dims of beta_fast and beta_slow rotations.
    base = float(params["rope_theta"])
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or model_max / original
    scale = params.get("attention_factor")
    if scale is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        scale = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                 if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(scale)


def _proportional(dim: int, params: dict[str, Any]) -> torch.Tensor:
    # Frequencies are spaced over the whole head, but only the first
    # partial_rotary_factor of them turn; the rest are zero (cos 1, sin 0).
    angles = int(float(params.get("partial_rotary_factor", 1.0)) * dim // 2)
    base = float(params["rope_theta"])
    turning = 1.0 / base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim)
    inv_freq = torch.cat((turning, torch.zeros(dim // 2 - angles)))
    return inv_freq / float(params.get("factor", 1.0))


def inv_freq_and_scale(dim: int, params: dict[str, Any], max_position: int, model_max: int
                       ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for ``dim`` rotated features and the factor on cos/sin.
    ``max_position`` is how far the engine may run, ``model_max`` the config's maximum."""
    if params["rope_type"] == "longrope":
        return _longrope(dim, params, max_position, model_max)
    if params["rope_type"] == "yarn":
        return _yarn(dim, params, model_max)
    if params["rope_type"] == "proportional":
        return _proportional(dim, params), 1.0
    return _inv_freq(dim, params), 1.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


class ScaledRotaryEmbedding(nn.Module):
    """Applies RoPE to the first ``rotary_dim`` features of each query and key head."""

    def __init__(self, rotary_dim: int, max_position: int, params: dict[str, Any],
                 model_max: int | None = None, interleaved: bool = False) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq, scale = inv_freq_and_scale(rotary_dim, params, max_position,
                                             model_max or max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
        self.rotate = _rotate_pairs if interleaved else _rotate_half
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == x.shape[-1]:
            return x * cos + self.rotate(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((rot * cos + self.rotate(rot) * sin, rest), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]."""
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def rotate_one(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """RoPE on a single [T, H, D] tensor (a query whose keys are already cached)."""
        cos = self.cos_cache[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(x.dtype)
        return self._apply(x, cos, sin)
