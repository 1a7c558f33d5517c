"""RMSNorm, with the residual add fused in front the way decoder layers use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rvllm.layers.backend import use_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One op instead of six, bit-identical in float32 (tests/test_layers.py).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Statistics in float32 whatever the compute dtype, as transformers does.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual)."""
        if use_triton() and type(self) is RMSNorm:
            from rvllm.kernels.triton.rms_norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma stores ``w`` and scales by ``1 + w``, multiplying in float32 before the cast
    back (Llama casts first, then scales)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
