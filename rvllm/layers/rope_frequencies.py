"""RoPE's inverse frequencies under each scaling a config may name, and the factor some
scalings put on cos and sin: the tables both ``rotary`` (the rotate-half RoPE of the
Llama-shaped families) and ``rotary_scaled`` (partial and interleaved RoPE) build."""

from __future__ import annotations

import math
from typing import Any

import torch

# The scalings RotaryEmbedding takes (``rotary.rope_parameters``), and the further ones
# ScaledRotaryEmbedding takes (``rotary_scaled.rope_type_of``).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SCALED_ROPE_TYPES = ("longrope", "yarn", "proportional")


def inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
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
    return inv_freq(dim, params), 1.0
