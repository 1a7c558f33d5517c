"""How many KV blocks fit: from --num-gpu-blocks, or from a memory budget."""

from __future__ import annotations

import torch

from rvllm.config import CacheConfig, ModelConfig, SchedulerConfig


def bytes_per_block(model: ModelConfig, block_size: int) -> int:
    """Keys and values (or MLA latents) of every layer for one block of tokens."""
    elem = torch.empty((), dtype=model.dtype).element_size()
    return model.num_layers * block_size * model.kv_elements_per_token * elem


def determine_num_blocks(model: ModelConfig, cache: CacheConfig, sched: SchedulerConfig,
                         device: torch.device) -> int:
    if cache.num_gpu_blocks is not None:
        return cache.num_gpu_blocks
    per_block = bytes_per_block(model, cache.block_size)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1.0 - cache.gpu_memory_utilization) * total
    else:
        budget = cache.kv_cache_memory_gb * (1 << 30)
    num_blocks = int(budget // per_block)
    # More blocks than every sequence at full length could use only waste memory.
    blocks_per_seq = -(-model.max_model_len // cache.block_size)
    num_blocks = min(num_blocks, sched.max_num_seqs * blocks_per_seq)
    if num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: one block needs {per_block / 2**20:.1f} MiB. "
            "Raise --kv-cache-memory (CPU) or --gpu-memory-utilization (GPU)."
        )
    return num_blocks
