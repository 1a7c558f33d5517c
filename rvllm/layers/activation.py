"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rvllm.layers.backend import use_triton


class SiluAndMul(nn.Module):
    """silu(gate) * up, with gate and up side by side in the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton():
            from rvllm.kernels.triton.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """gelu(gate) * up (Gemma's GeGLU); ``approximate="tanh"`` is gelu_pytorch_tanh."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
