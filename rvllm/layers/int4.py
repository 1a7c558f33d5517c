"""4-bit weights in groups: the form every int4 path shares, and a round-to-nearest
quantizer.

`Int4Weight` holds one linear layer's weight unpacked: `q` uint8 `[N, K]` (0..15), and per
group of `group` consecutive inputs of one output row a float32 `scale` and `zero`, the
weight being `scale * (q - zero)`. Checkpoints unpack into it (`models.int4_checkpoint`:
AWQ, GPTQ, compressed-tensors); `quantize_int4_rtn` makes one from a float weight
(`--quantization int4`); the CPU's packed kernels (as Q4_1 blocks) and the GPU's W4A16
kernel (`layers.gpu_quant`) compute with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

# Group sizes the unpacked form and the kernels support; -1 (in a config) means one group
# per output row ("per channel"), which becomes `group = K` in an `Int4Weight`.
SUPPORTED_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, eq=False)
class Int4Weight:
    """One linear's INT4 weight, unpacked: `weight = scale * (q - zero)` per group.

    `q` uint8 `[N, K]` (0..15, one per weight), `scale` and `zero` float32 `[N, K // group]`;
    group `j` of a row covers inputs `j * group .. (j + 1) * group - 1`.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int

    def __post_init__(self) -> None:
        if self.q.dtype != torch.uint8 or self.q.dim() != 2:
            raise ValueError(f"Int4Weight.q must be a 2-D uint8 tensor, got {self.q.dtype} "
                             f"of shape {tuple(self.q.shape)}")
        n, k = self.q.shape
        if self.group <= 0 or k % self.group:
            raise ValueError(f"Int4Weight group {self.group} does not divide K = {k}")
        expected = (n, k // self.group)
        for field in ("scale", "zero"):
            value = getattr(self, field)
            if value.dtype != torch.float32 or tuple(value.shape) != expected:
                raise ValueError(f"Int4Weight.{field} must be float32 of shape {expected}, got "
                                 f"{value.dtype} of shape {tuple(value.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """`(N, K)`: output rows by inputs."""
        return self.q.shape[0], self.q.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 `[N, K]` weight, `scale * (q - zero)` per group, in float32."""
        n, k = self.q.shape
        groups = self.q.reshape(n, k // self.group, self.group).float()
        return ((groups - self.zero.unsqueeze(-1)) * self.scale.unsqueeze(-1)).reshape(n, k)

    def rows(self, start: int, length: int) -> Int4Weight:
        """Output rows `start .. start + length - 1` (e.g. one shard, or one of q/k/v)."""
        n = self.q.shape[0]
        if start < 0 or length < 0 or start + length > n:
            raise ValueError(f"rows {start}..{start + length} out of range for {n} rows")
        stop = start + length
        return Int4Weight(self.q[start:stop], self.scale[start:stop], self.zero[start:stop],
                          self.group)

    @staticmethod
    def cat(parts: Iterable[Int4Weight]) -> Int4Weight:
        """The output rows of `parts` one after another (same K and group in all)."""
        parts = list(parts)
        if not parts:
            raise ValueError("Int4Weight.cat needs at least one part")
        k, group = parts[0].q.shape[1], parts[0].group
        for part in parts[1:]:
            if part.q.shape[1] != k or part.group != group:
                raise ValueError(f"Int4Weight.cat: parts differ in K or group "
                                 f"({k}, {group}) vs ({part.q.shape[1]}, {part.group})")
        return Int4Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]), group)


# ---------------------------------------------------------------- config


def quantize_int4_rtn(weight: torch.Tensor, group: int) -> Int4Weight:
    """Round-to-nearest asymmetric INT4 quantization of a `[N, K]` weight, in float32.

    For each run of `group` consecutive inputs of one output row (`group` 32, 64 or 128,
    dividing K, else `ValueError`): `lo = min(min(w), 0)`, `hi = max(max(w), 0)` (the range
    always contains 0, as in GPTQ's quantizer, so the zero point is exact), `scale = (hi -
    lo) / 15` (1 where that is 0, i.e. an all-zero group), `zero = clamp(round(-lo / scale),
    0, 15)`, `q = clamp(round(w / scale + zero), 0, 15)`; rounding is half-to-even. Then
    `|w - scale * (q - zero)| <= scale / 2` for every weight, up to float32 rounding.
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize_int4_rtn needs a 2-D weight, got shape "
                         f"{tuple(weight.shape)}")
    if group not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"quantize_int4_rtn: group = {group!r} is not supported (supported: "
                         f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))})")
    n, k = weight.shape
    if k % group:
        raise ValueError(f"quantize_int4_rtn: K = {k} is not a multiple of group {group}")
    w = weight.detach().to(torch.float32).reshape(n, k // group, group)
    lo = w.amin(dim=-1).clamp(max=0)
    hi = w.amax(dim=-1).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(w / scale.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15)
    return Int4Weight(q.to(torch.uint8).reshape(n, k), scale, zero, group)
