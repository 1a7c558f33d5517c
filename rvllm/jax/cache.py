"""The paged KV cache as JAX arrays: per stack (shape class of layer) one key and one value
array ``[layers, num_blocks, block_size, kv_heads, head_dim]``, indexed by the block
manager's block ids unchanged. The step takes the caches as a donated argument and hands
them back: XLA updates them in place (no copy of the cache per step)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rvllm.jax.weights import ModelSpec

# One stack's cache: {"k": array, "v": array}.
KVCache = dict[str, Any]


def allocate(spec: ModelSpec, num_blocks: int, block_size: int, dtype: Any,
             device: jax.Device) -> list[KVCache]:
    """Zeroed caches for every stack of ``spec`` on ``device``."""
    caches = []
    for stack in spec.stacks:
        shape = (stack.num_layers, num_blocks, block_size, stack.num_kv_heads, stack.head_dim)
        caches.append({"k": jnp.zeros(shape, dtype, device=device),
                       "v": jnp.zeros(shape, dtype, device=device)})
    return caches


def cache_bytes(caches: list[KVCache]) -> int:
    """The bytes of every key and value array."""
    return sum(c["k"].nbytes + c["v"].nbytes for c in caches)


def block_bytes(caches: list[KVCache]) -> int:
    """The bytes of one block id across every stack's keys and values."""
    return sum(c[name].nbytes // c[name].shape[1] for c in caches for name in ("k", "v"))
