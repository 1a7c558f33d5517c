"""Reading a GGUF file's header: its metadata and where each tensor's bytes are.

This part needs neither torch nor the decoders (``models.dequant``), so a process that
only reads a GGUF file's tokenizer or config (the server's front process) starts without
them. The reader is our own rather than `gguf.GGUFReader`: it parses string arrays
(the vocabulary) in one pass instead of one numpy object per part, and it checks every
length against the file size before reading, so a truncated or corrupt file fails with a
`ValueError` instead of an IndexError, a hang or a huge allocation. Tensor data stays in
a copy-on-write memory map until it is dequantized.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rvllm.models.ggml_types import tensor_nbytes

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
GGUF_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4
_MAX_ARRAY_DEPTH = 4
_U64 = struct.Struct("<Q")
_STRING, _ARRAY = 8, 9
# Value type id -> (struct format, numpy dtype) for the fixed-size scalar types.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}  # fmt: skip


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

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row: a vocabulary's tokens or merges, often 100k of them,
        so the loop keeps to locals (5x faster than ``string`` per element)."""
        buf, pos, end = self.buf, self.pos, self.end
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                if n > end - pos:
                    raise _Corrupt(f"{what} at byte {pos} runs past the end of the file")
                append(str(buf[pos : pos + n], "utf-8"))
                pos += n
        except struct.error:
            raise _Corrupt(f"{what} at byte {pos} runs past the end of the file") from None
        except UnicodeDecodeError:
            raise _Corrupt(f"{what} holds a string at byte {pos} that is not UTF-8") from None
        self.pos = pos
        return out

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
            return self.strings(count, what)
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

    def release_pages(self) -> None:
        """Give back the pages of the file this process has read (``madvise``
        ``MADV_DONTNEED``): they stay in the page cache, and a later read maps them again,
        but the process's resident memory no longer counts them. A model keeps no view
        of the file once loaded (its weights are decoded or repacked copies), so after
        loading this leaves its resident memory at the weights' own bytes, not those plus
        the file's."""
        import mmap

        handle = getattr(self._data, "_mmap", None)
        if handle is not None and hasattr(mmap, "MADV_DONTNEED"):
            handle.madvise(mmap.MADV_DONTNEED)

    def raw(self, name: str) -> np.ndarray:
        """The bytes of tensor `name` as a uint8 array viewing the memory map."""
        info = self.tensors[name]
        return self._data[info.offset : info.offset + info.nbytes]

    def load(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` dequantized to float32, in torch order, as the file stores it
        (into ``out`` when given: see ``dequantize``)."""
        from rvllm.models.dequant import dequantize

        info = self.tensors[name]
        return dequantize(self.raw(name), info.ggml_type, info.shape, out)


@functools.lru_cache(maxsize=4)
def _parsed(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(source: str | os.PathLike[str] | GGUFFile) -> GGUFFile:
    """The parsed file, parsed once however many readers ask (the config, the tokenizer
    and the weights all start from the same metadata: 0.4 s a parse for a 49k-token
    vocabulary). A file changed on disk since is parsed anew."""
    if isinstance(source, GGUFFile):
        return source
    path = os.path.abspath(source)
    stat = os.stat(path)
    return _parsed(path, stat.st_mtime_ns, stat.st_size)
