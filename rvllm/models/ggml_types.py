"""ggml's tensor types: their ids in a GGUF file and the size of their blocks. Both the
GGUF reader (``gguf_file``) and the decoders (``dequant``) read these; they need
nothing else."""

from __future__ import annotations

import enum


class GGMLType(enum.IntEnum):
    """A tensor's type id in a GGUF file (ggml's ``ggml_type``). Our own table, not the
    ``gguf`` package's: importing that package cost the engine's start 0.07-0.3 s (a test
    holds the two tables equal)."""

    F32, F16, Q4_0, Q4_1 = 0, 1, 2, 3
    Q5_0, Q5_1, Q8_0, Q8_1 = 6, 7, 8, 9
    Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K = 10, 11, 12, 13, 14, 15
    IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS = range(16, 24)
    I8, I16, I32, I64, F64, IQ1_M, BF16 = range(24, 31)
    TQ1_0, TQ2_0, MXFP4, NVFP4, Q1_0 = 34, 35, 39, 40, 41


# Type id -> (weights a block, bytes a block).
GGML_BLOCK_SIZES: dict[int, tuple[int, int]] = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20), GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34), GGMLType.Q8_1: (32, 40), GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144), GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210), GGMLType.Q8_K: (256, 292), GGMLType.IQ2_XXS: (256, 66),
    GGMLType.IQ2_XS: (256, 74), GGMLType.IQ3_XXS: (256, 98), GGMLType.IQ1_S: (256, 50),
    GGMLType.IQ4_NL: (32, 18), GGMLType.IQ3_S: (256, 110), GGMLType.IQ2_S: (256, 82),
    GGMLType.IQ4_XS: (256, 136), GGMLType.I8: (1, 1), GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4), GGMLType.I64: (1, 8), GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (256, 56), GGMLType.BF16: (1, 2), GGMLType.TQ1_0: (256, 54),
    GGMLType.TQ2_0: (256, 66), GGMLType.MXFP4: (32, 17), GGMLType.NVFP4: (64, 36),
    GGMLType.Q1_0: (128, 18),
}


def ggml_type_name(ggml_type: int) -> str:
    """The ggml name of a tensor type id (`Q4_K`), or `type <id>` for an unknown id."""
    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def tensor_nbytes(ggml_type: int, num_elements: int) -> int:
    """Bytes that `num_elements` weights of `ggml_type` take in a GGUF file.

    Raises `ValueError` for an unknown type or a count that is not whole blocks.
    """
    # IntEnum keys hash as ints: plain ids index these tables without an enum lookup.
    if ggml_type not in GGML_BLOCK_SIZES:
        raise ValueError(f"unknown GGUF tensor type id {ggml_type}")
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    if num_elements % block_size:
        raise ValueError(
            f"{num_elements} elements is not a whole number of "
            f"{ggml_type_name(ggml_type)} blocks of {block_size}"
        )
    return num_elements // block_size * type_size
