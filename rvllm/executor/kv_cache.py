"""How many KV blocks fit: from --num-gpu-blocks, or from a memory budget."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from rvllm.config import CacheConfig, ModelConfig, SchedulerConfig


def bytes_per_block(model: ModelConfig, block_size: int,
                    cache_dtype: torch.dtype | None = None) -> int:
    """Keys and values (or MLA latents) of every layer for one block of tokens, stored as
    ``cache_dtype`` (default: the model's dtype)."""
    elem = torch.empty((), dtype=cache_dtype or model.dtype).element_size()
    return model.num_layers * block_size * model.kv_elements_per_token * elem


def gpu_kv_budget(total: int, used: int, utilization: float, reserve: int) -> int:
    """Bytes the KV cache may take on a GPU of ``total`` bytes: the process may grow to
    ``utilization`` of the card and must leave ``reserve`` bytes free (so utilization 1.0
    with a reserve is safe), less the ``used`` bytes it holds at its peak without a cache
    (weights, the activations of the largest step, the CUDA context)."""
    return int(min(utilization * total, total - reserve) - used)


def measure_used_gpu_memory(device: torch.device, profile: Callable[[], None]) -> int:
    """Peak bytes in use on ``device`` while ``profile`` (a forward pass at the largest
    step) runs, plus what lives outside PyTorch's allocator (the CUDA context)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    return peak + outside_torch


def estimate_weight_bytes(model: ModelConfig) -> int:
    """The weights' size before they are loaded: their files on disk (a GGUF's quantized
    blocks grow when dequantized, so those count at the compute dtype's size per element of
    a rough parameter count instead)."""
    path = Path(model.path)
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    if files and model.gguf_file is None:
        return sum(f.stat().st_size for f in files)
    h, layers = model.hidden_size, model.num_layers
    inter = int(model.hf_config.get("intermediate_size") or 4 * h)
    params = layers * (4 * h * h + 3 * h * inter) + 2 * model.vocab_size * h
    return params * torch.empty((), dtype=model.dtype).element_size()


def determine_num_blocks(model: ModelConfig, cache: CacheConfig, sched: SchedulerConfig,
                         device: torch.device, used_bytes: int | None = None,
                         tensor_parallel_size: int = 1) -> int:
    """``--num-gpu-blocks``, else as many blocks as the memory budget holds: on a GPU,
    :func:`gpu_kv_budget` with ``used_bytes`` from the profiling pass (or, when the
    weights are not loaded yet, what is in use now plus this rank's share of them); on
    the CPU, ``--kv-cache-memory``."""
    if cache.num_gpu_blocks is not None:
        return cache.num_gpu_blocks
    per_block = bytes_per_block(model, cache.block_size, cache.cache_dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if used_bytes is None:
            used_bytes = total - free + estimate_weight_bytes(model) // tensor_parallel_size
        budget = gpu_kv_budget(total, used_bytes, cache.gpu_memory_utilization,
                               int(cache.gpu_memory_reserve_gb * (1 << 30)))
    else:
        budget = cache.kv_cache_memory_gb * (1 << 30)
    return blocks_for_budget(budget, per_block, model, cache, sched)


def blocks_for_budget(budget: float, per_block: int, model: ModelConfig, cache: CacheConfig,
                      sched: SchedulerConfig) -> int:
    num_blocks = int(max(budget, 0) // per_block)
    # More blocks than every sequence at full length could use only waste memory.
    blocks_per_seq = -(-model.max_model_len // cache.block_size)
    num_blocks = min(num_blocks, sched.max_num_seqs * blocks_per_seq)
    if num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: one block needs {per_block / 2**20:.1f} MiB and "
            f"{max(budget, 0) / 2**20:.0f} MiB are left. Raise --kv-cache-memory (CPU), or "
            "--gpu-memory-utilization or lower --gpu-memory-reserve-gb (GPU)."
        )
    return num_blocks


def empty_cpu_cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for KV-cache blocks, in ordinary 4 KiB pages.

    Huge pages (``rvllm.host_memory``) once took a decode step's key and value writes from
    0.19-0.23 ms to 0.03-0.05 ms of a 17-19 ms N=1 step (random Llama, a Zen 4 with 8 MB of
    L3). On a Zen 3 with 32 MB of L3 the step was as fast either way (SmolLM2, ten
    alternated pairs: 15.6-25.0 ms a step, the pairs' differences -2.0 to +1.6 ms, mean
    +0.05). And with huge pages the first write to each of the cache's tensors (a layer's
    keys or values: 60 for SmolLM2) fills a whole 2 MiB page: 0.2-2.9 ms apiece on a
    virtual machine whose host takes back free memory, 105-150 ms of the first prefill in
    ``rvllm serve``'s engine process. With 4 KiB pages the first requests touch only the
    pages their blocks are in. Those first writes still cost a decode step 40-80 us a
    fresh page there; the engine's idle work faults in the blocks it will hand out next
    beforehand (``engine.idle_work.IdleWork``)."""
    return torch.empty(shape, dtype=dtype)
