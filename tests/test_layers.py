"""Plain-torch layers against the formulas they shortcut."""

from __future__ import annotations

import torch

from rvllm.forward_context import AttentionMetadata
from rvllm.layers.norm import RMSNorm


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def test_float32_rms_norm_is_bit_identical_to_the_explicit_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    for rows in (1, 7, 300):
        x, residual = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen)
        assert torch.equal(norm(x), reference_rms_norm(x, norm.weight, 1e-5))
        out, summed = norm(x, residual)
        assert torch.equal(summed, residual + x)
        assert torch.equal(out, reference_rms_norm(residual + x, norm.weight, 1e-5))


def decode_metadata(lens: list[int]) -> AttentionMetadata:
    slots = torch.zeros(len(lens), max(lens), dtype=torch.long)
    return AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), len(lens), slots,
                             torch.tensor(lens), [])


def test_decode_mask_is_none_when_every_row_attends_to_everything() -> None:
    assert decode_metadata([5, 5, 5]).decode_mask(None, torch.float32) is None
    # A window shorter than the context masks the oldest positions.
    window = decode_metadata([5, 5]).decode_mask(3, torch.float32)
    assert window is not None and window[0, 0, 0].tolist() == [-torch.inf] * 2 + [0.0] * 3


def test_decode_mask_is_additive_minus_inf_past_each_rows_length() -> None:
    mask = decode_metadata([2, 4]).decode_mask(None, torch.float32)
    assert mask is not None and mask.shape == (2, 1, 1, 4) and mask.dtype == torch.float32
    assert mask[0, 0, 0].tolist() == [0.0, 0.0, -torch.inf, -torch.inf]
    assert mask[1, 0, 0].tolist() == [0.0] * 4
