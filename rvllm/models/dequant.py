"""Dequantization of GGUF tensor data to float32, vectorized with torch (and, for Q8_0,
Q4_0 and Q4_1, in one numba pass: ``kernels.cpu.dequant``).

Each quantized type stores fixed-size blocks of bytes; a block holds `block_size`
weights. Every decoder below takes a `[n_blocks, type_size]` uint8 tensor and
returns `[n_blocks, block_size]` float32, doing its arithmetic in float32 in the
same order as ggml's reference dequantizers, so the results are bit-identical.
"""

import math
from collections.abc import Callable

import numpy as np
import torch

from rvllm.models.ggml_types import GGML_BLOCK_SIZES, GGMLType, ggml_type_name, tensor_nbytes

# Big tensors are decoded in slices of this many blocks so the temporaries stay small.
_CHUNK_BLOCKS = 1 << 16

_Decoder = Callable[[torch.Tensor], torch.Tensor]


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as a `[n_blocks, 1]` float32 column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """Split `[n, groups * k]` bytes into `[n, groups * 2, k]` 4-bit values.

    Within each group of k bytes the low nibbles come first, then the high ones.
    """
    packed = packed.reshape(packed.shape[0], groups, 1, -1)
    both = torch.cat((packed & 0x0F, packed >> 4), dim=2)
    return both.reshape(packed.shape[0], groups * 2, -1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12 bytes of eight 6-bit (scale, min) pairs used by Q4_K and Q5_K."""
    low, high, mixed = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    scale = torch.cat((low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)), dim=1)
    minimum = torch.cat((high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)), dim=1)
    return scale.float().unsqueeze(-1), minimum.float().unsqueeze(-1)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16_type(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # A bfloat16 is the top half of a float32: shifting keeps NaN payloads bit-exact.
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:], 1).reshape(blocks.shape[0], -1).to(torch.int16) - 8
    return _f16(blocks, 0) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:], 1).reshape(blocks.shape[0], -1).float()
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, minimum = _k_scales(blocks[:, 4:16])
    d = _f16(blocks, 0).unsqueeze(-1) * scale
    dm = _f16(blocks, 2).unsqueeze(-1) * minimum
    q = _nibbles(blocks[:, 16:], 4).float()  # [n, 8 sub-blocks, 32]
    return (d * q - dm).reshape(blocks.shape[0], -1)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, minimum = _k_scales(blocks[:, 4:16])
    d = _f16(blocks, 0).unsqueeze(-1) * scale
    dm = _f16(blocks, 2).unsqueeze(-1) * minimum
    low = _nibbles(blocks[:, 48:], 4)  # [n, 8, 32]
    # Bit i of each of the 32 qh bytes is the fifth bit of sub-block i.
    qh = blocks[:, 16:48].unsqueeze(1)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    high = (qh >> shifts) & 1
    return (d * (low | (high << 4)).float() - dm).reshape(blocks.shape[0], -1)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 2).reshape(n, 8, 32)
    # Each qh byte carries the top two bits of four weights, one per 32-wide row.
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((qh >> shifts) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).reshape(n, 16, 16).float()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks, 208) * scales).unsqueeze(-1)  # one scale per 16 weights
    return (d * q).reshape(n, -1)


_DECODERS: dict[GGMLType, _Decoder] = {
    GGMLType.F32: _f32,
    GGMLType.F16: _f16_type,
    GGMLType.BF16: _bf16,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}

SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in _DECODERS)


def check_supported(ggml_type: int) -> None:
    """Raise `ValueError` unless `dequantize` can decode `ggml_type`."""
    if ggml_type not in _DECODERS:
        raise ValueError(
            f"GGUF tensor type {ggml_type_name(ggml_type)} is not supported; "
            f"supported: {', '.join(SUPPORTED_TYPES)}"
        )


# Q8_0, Q4_0 and Q4_1 also decode in one numba pass (kernels.cpu.dequant), bit-identical
# to the decoders above; set False to keep to torch.
USE_NUMBA = True


def _use_numba(ggml_type: int) -> bool:
    return USE_NUMBA and ggml_type in (GGMLType.Q8_0, GGMLType.Q4_0,
                                        GGMLType.Q4_1)


def dequantize(
    raw: np.ndarray | memoryview | bytes, ggml_type: int, shape: tuple[int, ...],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode the raw bytes of one GGUF tensor into a float32 tensor of `shape`: into
    `out` when given (a contiguous float32 tensor of that many elements, e.g. the model
    parameter the values belong in; the result is then a view of it).

    `shape` is in torch order (GGUF lists dimensions the other way round); only
    the element count matters for decoding.
    """
    check_supported(ggml_type)
    nbytes = tensor_nbytes(ggml_type, math.prod(shape))
    data = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=np.uint8)
    data = data.reshape(-1).view(np.uint8)
    if data.nbytes != nbytes:
        raise ValueError(
            f"{ggml_type_name(ggml_type)} tensor of shape {tuple(shape)} needs {nbytes} bytes, "
            f"got {data.nbytes}"
        )
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    if out is None:
        out = torch.empty(data.nbytes // type_size, block_size, dtype=torch.float32)
    elif (out.dtype != torch.float32 or not out.is_contiguous()
          or out.numel() != math.prod(shape)):
        raise ValueError(f"cannot decode a {tuple(shape)} tensor into a {out.dtype} tensor of "
                         f"shape {tuple(out.shape)}")
    out = out.view(data.nbytes // type_size, block_size)
    if _use_numba(ggml_type):  # reads the (memory-mapped, read-only) bytes in place
        from rvllm.kernels.cpu.dequant import dequantize_into

        dequantize_into(ggml_type_name(ggml_type), data.reshape(-1, type_size), out.numpy())
        return out.reshape(shape)
    if not data.flags.writeable:
        # torch wants writable memory; the decoders never write, so a read-only
        # view (e.g. of a memory map) would be safe, but copy to stay warning-free.
        data = data.copy()
    blocks = torch.from_numpy(data).reshape(-1, type_size)
    decode = _DECODERS[ggml_type]
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        out[start:stop] = decode(blocks[start:stop]).reshape(-1, block_size)
    return out.reshape(shape)
