"""Reading GGUF files: metadata, a Hugging Face-style config, and HF-named weights.

The reader is our own rather than `gguf.GGUFReader`: it parses string arrays
(the vocabulary) in one pass instead of one numpy object per part, and it checks
every length against the file size before reading, so a truncated or corrupt file
fails with a `ValueError` instead of an IndexError, a hang or a huge allocation.
Tensor data stays in a copy-on-write memory map until it is dequantized.
"""

import math
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rvllm.models.dequant import check_supported, dequantize, tensor_nbytes

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
GGUF_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4
_MAX_ARRAY_DEPTH = 4
_STRING, _ARRAY = 8, 9
# Value type id -> (struct format, numpy dtype) for the fixed-size scalar types.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}  # fmt: skip

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Precomputed RoPE frequency factors (llama3 scaling); the config's rope_scaling
# carries the same information, so the model has no parameter for it.
_IGNORED_TENSORS = {"rope_freqs.weight"}


class _Corrupt(Exception):
    """Raised inside the parser; GGUFFile turns it into a ValueError naming the file."""


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file. `shape` is in torch order."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


class _Cursor:
    """Bounds-checked little-endian reads from a buffer."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos, self.end = buf, 0, len(buf)

    def take(self, n: int, what: str) -> int:
        if n < 0 or n > self.end - self.pos:
            raise _Corrupt(f"{what} at byte {self.pos} runs past the end of the file")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, vtype: int, what: str) -> Any:
        fmt = _SCALARS[vtype][0]
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(10, what)
        start = self.take(n, what)
        try:
            return str(self.buf[start : start + n], "utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"{what} holds a string at byte {start} that is not UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY and depth < _MAX_ARRAY_DEPTH:
            return self.array(what, depth)
        raise _Corrupt(f"{what} has unknown value type {vtype}")

    def array(self, what: str, depth: int) -> list[Any]:
        etype, count = self.scalar(4, what), self.scalar(10, what)
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1])
            start = self.take(count * dtype.itemsize, what)
            return np.frombuffer(self.buf, dtype, count, start).tolist()
        # Every element takes at least 8 bytes (a string or array length), which
        # bounds the loop by the file size even when `count` is corrupt.
        if count * 8 > self.end - self.pos:
            raise _Corrupt(f"{what} claims {count} elements, more than the file holds")
        if etype == _STRING:
            return [self.string(what) for _ in range(count)]
        return [self.value(etype, what, depth + 1) for _ in range(count)]


class GGUFFile:
    """A parsed GGUF file: `metadata` (key -> value) and `tensors` (name -> info).

    Raises `ValueError` naming the file when it is not a valid GGUF file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 24:
            raise ValueError(f"{self.path} is not a GGUF file: {size} bytes, shorter than a header")
        # Copy-on-write: torch gets writable arrays without copying the file.
        self._data = np.memmap(self.path, dtype=np.uint8, mode="c")
        try:
            self._parse(memoryview(self._data))
        except (_Corrupt, ValueError, OverflowError) as e:
            raise ValueError(f"{self.path} is not a valid GGUF file: {e}") from None

    def _parse(self, buf: memoryview) -> None:
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise _Corrupt(f"bad magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r}")
        cur = _Cursor(buf)
        cur.pos = 4
        self.version = cur.scalar(4, "version")
        if self.version not in GGUF_VERSIONS:
            raise _Corrupt(f"unsupported version {self.version} (supported: {GGUF_VERSIONS})")
        n_tensors, n_kv = cur.scalar(10, "tensor count"), cur.scalar(10, "metadata count")
        self.metadata: dict[str, Any] = {}
        for _ in range(min(n_kv, cur.end)):  # each entry takes bytes, so this bounds a bad count
            key = cur.string("metadata key")
            self.metadata[key] = cur.value(cur.scalar(4, key), f"metadata {key!r}")
        infos = [self._tensor_info(cur) for _ in range(min(n_tensors, cur.end))]
        alignment = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise _Corrupt(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, offset in infos:
            if name in self.tensors:
                raise _Corrupt(f"tensor {name!r} appears twice")
            nbytes = tensor_nbytes(ggml_type, math.prod(shape))
            if offset % alignment or data_start + offset + nbytes > cur.end:
                raise _Corrupt(f"data of tensor {name!r} runs past the end of the file")
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, data_start + offset, nbytes)

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string("tensor name")
        n_dims = cur.scalar(4, f"tensor {name!r}")
        if n_dims > _MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
        dims = [cur.scalar(10, f"tensor {name!r}") for _ in range(n_dims)]
        ggml_type, offset = cur.scalar(4, f"tensor {name!r}"), cur.scalar(10, f"tensor {name!r}")
        return name, tuple(reversed(dims)), ggml_type, offset

    @property
    def architecture(self) -> str:
        """`general.architecture`, e.g. `llama`."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path} has no general.architecture in its metadata")
        return arch

    def raw(self, name: str) -> np.ndarray:
        """The bytes of tensor `name` as a uint8 array viewing the memory map."""
        info = self.tensors[name]
        return self._data[info.offset : info.offset + info.nbytes]

    def load(self, name: str) -> torch.Tensor:
        """Tensor `name` dequantized to float32, in torch order, as the file stores it."""
        info = self.tensors[name]
        return dequantize(self.raw(name), info.ggml_type, info.shape)


def _open(source: "str | os.PathLike[str] | GGUFFile") -> GGUFFile:
    return source if isinstance(source, GGUFFile) else GGUFFile(source)


def _check_architecture(gguf: GGUFFile) -> str:
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    if (original := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def load_gguf_config(source: "str | os.PathLike[str] | GGUFFile") -> dict[str, Any]:
    """A Hugging Face-style model config dict built from a GGUF file's metadata."""
    gguf = _open(source)
    arch = _check_architecture(gguf)
    meta = gguf.metadata

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{gguf.path}: metadata {arch}.{key} is missing")
        return value

    num_heads = get("attention.head_count")
    has_bias = "blk.0.attn_q.bias" in gguf.tensors
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "hidden_act": "silu",
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        "vocab_size": get("vocab_size", len(meta.get("tokenizer.ggml.tokens", ())) or None),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": True if arch == "qwen2" else has_bias,
    }
    # llama.cpp's rope dimension is the head size for llama (full rotary).
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = meta.get("llama.rope.dimension_count")
    if head_dim is not None:
        config["head_dim"] = head_dim
    if (scaling := _rope_scaling(meta, arch)) is not None:
        config["rope_scaling"] = scaling
    for name in ("bos", "eos", "pad", "unk"):
        key = "unknown" if name == "unk" else "padding" if name == "pad" else name
        if (token_id := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{name}_token_id"] = token_id
    return config


def _hf_name(name: str) -> str | None:
    """The Hugging Face parameter name for GGUF tensor `name`; None to skip it."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    if name in _IGNORED_TENSORS:
        return None
    m = _LAYER_NAME.fullmatch(name)
    if m is None or m[2] not in _LAYER_TENSORS:
        raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart")
    return f"model.layers.{m[1]}.{_LAYER_TENSORS[m[2]]}.{m[3]}"


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's Q/K row permutation.

    llama.cpp's RoPE rotates adjacent pairs (x0, x1), HF's rotates the two halves
    of each head (x_i, x_{i+d/2}); the converter interleaves each head's halves
    and this puts them back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of even size")
    w = w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
    return w.transpose(1, 2).reshape(rows, *w.shape[3:])


def iter_gguf_tensors(
    source: "str | os.PathLike[str] | GGUFFile", dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every weight in the file, dequantized to `dtype`.

    Names and shapes are those of the Hugging Face model; for the `llama`
    architecture Q and K are un-permuted, so the weights equal HF's exactly.
    """
    gguf = _open(source)
    arch = _check_architecture(gguf)
    names = {name: _hf_name(name) for name in gguf.tensors}
    for info in gguf.tensors.values():  # fail before any work, not halfway through
        try:
            check_supported(info.ggml_type)
        except ValueError as e:
            raise ValueError(f"{gguf.path}: tensor {info.name!r}: {e}") from None
    config = load_gguf_config(gguf)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for name, hf_name in names.items():
        if hf_name is None:
            continue
        tensor = gguf.load(name)
        kind = name.split(".")[2] if name.startswith("blk.") else None
        if arch == "llama" and kind in heads:
            tensor = _unpermute_rows(tensor, heads[kind])
        yield hf_name, tensor.to(dtype)
