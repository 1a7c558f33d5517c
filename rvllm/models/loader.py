"""Build a model and fill it from safetensors or GGUF files."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from rvllm.config import ModelConfig
from rvllm.layers.cpu_linear import prepare_linear_weights
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
    """Tensors one at a time from memory-mapped files, so peak memory stays at one tensor."""
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


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights from the config alone, for benchmarking shapes whose weights
    cannot be had: small normal values, norms at one (so activations stay sane). The
    values are drawn where the weights live (a 7B model's 7.6e9 draws take seconds on a
    GPU and minutes on one CPU thread), so they differ between devices for one seed."""
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
        from rvllm.models.base import checkpoint_destinations
        from rvllm.models.gguf_loader import iter_gguf_tensors

        weights = tqdm(iter_gguf_tensors(config.gguf_file, dtype=config.dtype,
                                         destination=checkpoint_destinations(model)),
                       desc="Loading GGUF tensors", unit="tensor", disable=not progress)
    else:
        weights = iter_safetensors(safetensors_files(Path(config.path)), progress)
    loaded = model.load_weights(weights)
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(
            f"the checkpoint in {config.path} lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )
    return _finish(model, start, cpu_linear_backend, quantization, wait_packing,
                       defer_reorders)


def _finish(model: nn.Module, start: float, cpu_linear_backend: str,
            quantization: str | None, wait_packing: bool, defer_reorders: bool) -> nn.Module:
    model.eval()
    model.linear_backend = prepare_linear_weights(model, cpu_linear_backend, quantization,
                                                  wait=wait_packing,
                                                  defer_reorders=defer_reorders)
    model.load_seconds = time.perf_counter() - start
    return model
