"""Rotary position embedding (rotate-half layout, as in Hugging Face checkpoints)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Rope settings from either the transformers 4 (rope_theta + rope_scaling) or the
    transformers 5 (rope_parameters) spelling of a config."""
    params = dict(hf_config.get("rope_scaling") or {})
    params.update(hf_config.get("rope_parameters") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    params["rope_type"] = rope_type
    return params


def _inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if params["rope_type"] == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif params["rope_type"] == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are stretched by `factor`, short ones kept,
    # and the band between is interpolated smoothly.
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
# id(cos table) -> (positions tensor, cos, sin) of the step in flight.
_MEMO: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _cos_sin(head_dim: int, max_position: int, params: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    # Every layer of a model uses the same tables: build them once.
    key = (head_dim, max_position, str(torch.get_default_device()), repr(sorted(params.items())))
    if key not in _TABLES:
        inv_freq = _inv_freq(head_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        _TABLES[key] = (emb.cos(), emb.sin())
    return _TABLES[key]


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key, given each token's absolute position."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        cos, sin = _cos_sin(head_dim, max_position, params)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _lookup(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer sees the same positions tensor in a step: gather cos/sin once.
        memo = _MEMO.get(id(self.cos_cache))
        if memo is not None and memo[0] is positions and memo[1].dtype == dtype:
            return memo[1], memo[2]
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        _MEMO[id(self.cos_cache)] = (positions, cos, sin)
        return cos, sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]."""
        cos, sin = self._lookup(positions, q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k
