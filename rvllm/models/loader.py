"""Build a model and fill it from safetensors or GGUF files."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from rvllm.config import ModelConfig
from rvllm.deferred_imports import import_for_generators
from rvllm.layers.cpu_linear import PACKED_QUANTIZATIONS, prepare_linear_weights
from rvllm.models.registry import get_model_class


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint shards of a Hugging Face directory, in index order."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards named in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights found in {path}.")
    return files


def iter_safetensors(files: list[Path], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors one at a time from memory-mapped files, as the files store them (dtype
    included): each a view of the file's memory map (safetensors' ``get_tensor`` copies
    nothing), so its bytes are read from the disk (or the page cache) once, by whatever
    copies them into their parameter."""
    total = 0
    handles = []
    for file in files:
        handle = safe_open(str(file), framework="pt")
        handles.append(handle)
        total += len(list(handle.keys()))
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress)
    for handle in handles:
        for name in handle.keys():
            yield name, handle.get_tensor(name)
            bar.update(1)
    bar.close()


class DeviceStager:
    """Host tensors (views of the memory-mapped files) to ``device`` through a ring of
    staging buffers: each tensor is cut into ``chunk_bytes`` pieces, each piece copied
    from the map into the next free buffer (where a cold page cache reads the disk) and
    from there to the device. On a CUDA device the buffers are pinned and the device
    copies asynchronous on the current stream, so the host's copy of one piece overlaps
    the DMA of the pieces before it; a buffer is reused once the event recorded after its
    last DMA has passed. Each tensor arrives whole on the device in the checkpoint's dtype
    (a temporary of its size); whoever copies it into its parameter converts it there.
    Elsewhere (the tests) the same pieces go through plain buffers."""

    def __init__(self, device: torch.device, chunk_bytes: int = 64 << 20, depth: int = 4
                 ) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda)
                        for _ in range(depth)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(depth)]
        self.stream = torch.cuda.current_stream(device) if cuda else None
        self.next = 0
        self.bytes = 0

    def __call__(self, host: torch.Tensor) -> torch.Tensor:
        host = host.contiguous()
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        src, dst = host.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)
        chunk = self.buffers[0].numel()
        for start in range(0, src.numel(), chunk):
            n = min(chunk, src.numel() - start)
            buffer, event = self.buffers[self.next], self.events[self.next]
            self.next = (self.next + 1) % len(self.buffers)
            if event is not None:
                event.synchronize()  # the last DMA out of this buffer is done
            buffer[:n].copy_(src[start:start + n])
            dst[start:start + n].copy_(buffer[:n], non_blocking=event is not None)
            if event is not None:
                event.record(self.stream)
        self.bytes += src.numel()
        return out

    def finish(self) -> None:
        """Wait for the last copies (so the load's seconds count them)."""
        if self.stream is not None:
            self.stream.synchronize()


def stages_to(device: torch.device) -> bool:
    """Whether safetensors weights go to ``device`` through a :class:`DeviceStager`: on a
    CUDA device on one rank. Tensor-parallel ranks take host tensors, so that each copies
    only its shard to its device (the layers' ``weight_loader`` narrows first)."""
    from rvllm.distributed import get_tp_size

    return device.type == "cuda" and get_tp_size() == 1


def staged(weights: Iterator[tuple[str, object]], stager: DeviceStager,
           skipped: Callable[[str], bool] = lambda name: False
           ) -> Iterator[tuple[str, object]]:
    """``weights`` with every tensor moved by ``stager``; anything else (packed rows), and
    the tensors the model skips (``skipped(name)``: a tied LM head's copy), as they come."""
    for name, tensor in weights:
        if isinstance(tensor, torch.Tensor) and not skipped(name):
            tensor = stager(tensor)
        yield name, tensor
    stager.finish()


def checkpoint_int4_method(model: str) -> str | None:
    """The int4 method (awq, gptq, compressed-tensors) a Hugging Face checkpoint's
    config.json names; None for none (or no config.json)."""
    from rvllm.models.int4_checkpoint import int4_config

    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        config = int4_config(json.load(f))
    return None if config is None else config.method


def gguf_has_packed_weights(path: str | Path) -> bool:
    """Whether a GGUF file's layers hold linear weights of a type kept packed
    (``kernels.cpu.packed``)."""
    from rvllm.kernels.cpu.packed import packable
    from rvllm.models.gguf_file import open_gguf

    return any(name.startswith("blk.") and len(info.shape) == 2
               and packable(info.ggml_type, info.shape[1])
               for name, info in open_gguf(path).tensors.items())


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights from the config alone, for benchmarking shapes whose weights
    cannot be had: small normal values, norms at one (so activations stay sane). The
    values are drawn where the weights live (a 7B model's 7.6e9 draws take seconds on a
    GPU and minutes on one CPU thread), so they differ between devices for one seed."""
    import_for_generators()
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
            continue
        dev = param.device
        if dev not in generators:
            generators[dev] = torch.Generator(device=dev).manual_seed(seed)
        param.data.normal_(0.0, 0.02, generator=generators[dev])


def load_model(config: ModelConfig, device: torch.device, progress: bool = False,
               load_format: str = "auto", cpu_linear_backend: str = "auto",
               quantization: str | None = None, wait_packing: bool = True,
               defer_reorders: bool = False) -> nn.Module:
    """Instantiate the registered class for ``config``, load its weights, and (on the CPU)
    repack or quantize the linear weights; ``model.linear_backend`` names the path. With
    ``wait_packing=False`` fbgemm's packing (``--quantization``) goes on on threads of its
    own after this returns: ``cpu_linear.finish_linear_weights(model)`` before the first
    forward. ``defer_reorders``: see ``cpu_linear.prepare_linear_weights``."""
    start = time.perf_counter()
    cls = get_model_class(config.architecture)
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device):
            model = cls(config.hf_config, config.max_model_len)
    finally:
        torch.set_default_dtype(torch.float32)
    if load_format == "dummy":
        init_dummy_weights(model)
        return _finish(model, start, cpu_linear_backend, quantization, wait_packing,
                       defer_reorders)
    if config.gguf_file is not None:
        from rvllm.models.base import checkpoint_destinations, packed_destinations
        from rvllm.models.gguf_loader import iter_gguf_tensors

        keep = packed_destinations(model) if quantization == "gguf" else None
        weights = tqdm(iter_gguf_tensors(config.gguf_file, dtype=config.dtype,
                                         destination=checkpoint_destinations(model),
                                         keep_packed=keep),
                       desc="Loading GGUF tensors", unit="tensor", disable=not progress)
    else:
        files = safetensors_files(Path(config.path))
        weights = iter_safetensors(files, progress)
        from rvllm.models.base import packed_destinations

        weights = _int4_weights(weights, config, packed_destinations(model)
                                if quantization in PACKED_QUANTIZATIONS else None)
        if stages_to(device):  # a small checkpoint pins no more than its size
            size = sum(f.stat().st_size for f in files)
            from rvllm.models.base import skipped_checkpoint_tensor

            weights = staged(weights, DeviceStager(device, min(64 << 20, max(size, 1))),
                             lambda name: skipped_checkpoint_tensor(model, name))
    loaded = model.load_weights(weights)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the staged tensors' blocks, for the KV cache's sizing
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(
            f"the checkpoint in {config.path} lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )
    model = _finish(model, start, cpu_linear_backend, quantization, wait_packing,
                    defer_reorders)
    if config.gguf_file is not None:
        from rvllm.models.gguf_file import open_gguf

        open_gguf(config.gguf_file).release_pages()  # the weights are copies now
    return model


def _int4_weights(weights: Iterator[tuple[str, torch.Tensor]], config: ModelConfig,
                  keep: Callable[[str], bool] | None) -> Iterator[tuple[str, object]]:
    """An int4 checkpoint's (AWQ, GPTQ, compressed-tensors: ``models.int4_checkpoint``)
    linear weights, each as Q4_1 blocks to keep packed (``kernels.cpu.packed``) where
    ``keep(name)`` says the engine runs them so, else dequantized to float32; other
    tensors as they come."""
    from rvllm.models.int4_checkpoint import Int4Weight, int4_config, iter_int4_weights

    int4 = int4_config(config.hf_config)
    if int4 is None:
        yield from weights
        return
    for name, tensor in iter_int4_weights(weights, int4):
        if not isinstance(tensor, Int4Weight):
            yield name, tensor
        elif keep is not None and keep(name) and tensor.shape[1] % 32 == 0:
            from rvllm.kernels.cpu.packed import int4_rows

            yield name, int4_rows(tensor.q, tensor.scale, tensor.zero)
        else:
            yield name, tensor.dequantize()


def _finish(model: nn.Module, start: float, cpu_linear_backend: str,
            quantization: str | None, wait_packing: bool, defer_reorders: bool) -> nn.Module:
    model.eval()
    if quantization in ("int4", "fp8") and any(p.device.type == "cuda"
                                               for p in model.parameters()):
        from rvllm.layers.gpu_quant import prepare_gpu_quantized

        prepare_gpu_quantized(model, quantization)  # Triton W4A16 / FP8 weights
        model.linear_backend = "w4a16" if quantization == "int4" else "fp8"
        model.load_seconds = time.perf_counter() - start
        return model
    model.linear_backend = prepare_linear_weights(model, cpu_linear_backend, quantization,
                                                  wait=wait_packing,
                                                  defer_reorders=defer_reorders)
    model.load_seconds = time.perf_counter() - start
    return model
