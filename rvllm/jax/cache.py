"""The paged KV cache as JAX arrays: per stack, per position of its pattern block, one key
and one value array ``[repeats, num_blocks, block_size, kv_heads, head_dim]`` (the layers
of that position, one per repeat of the block), indexed by the block manager's block ids
unchanged. A Gemma 4 layer that reads an earlier layer's cache has none (an empty dict).
The step takes the caches as a donated argument and hands them back: XLA updates them in
place (no copy of the cache per step). Under tensor parallelism every array is split by KV
head over the mesh (``rvllm.jax.sharding.cache_sharding``): each device holds its heads of
every block."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rvllm.jax.weights import ModelSpec

# One position's cache: {"k": array, "v": array}; a stack's is a list of them.
KVCache = dict[str, Any]


def allocate(spec: ModelSpec, num_blocks: int, block_size: int, dtype: Any,
             device: jax.Device | jax.sharding.Sharding) -> list[list[KVCache]]:
    """Zeroed caches for every stack of ``spec`` on ``device``, or placed by a sharding
    (each device allocates its own shard, never the whole array)."""
    caches = []
    for stack in spec.stacks:
        positions = []
        for kind in stack.pattern:
            if kind.kv_source is not None:
                positions.append({})
                continue
            shape = (stack.repeats, num_blocks, block_size, kind.num_kv_heads, kind.head_dim)
            positions.append({"k": jnp.zeros(shape, dtype, device=device),
                              "v": jnp.zeros(shape, dtype, device=device)})
        caches.append(positions)
    return caches


def _arrays(caches: list[list[KVCache]]) -> list[Any]:
    return [c[name] for stack in caches for c in stack if c for name in ("k", "v")]


def cache_bytes(caches: list[list[KVCache]]) -> int:
    """The bytes of every key and value array (their global size, over every device)."""
    return sum(a.nbytes for a in _arrays(caches))


def device_cache_bytes(caches: list[list[KVCache]]) -> int:
    """The bytes one device holds of every key and value array: the whole cache on one
    device, its share of the KV heads under tensor parallelism."""
    return sum(a.addressable_shards[0].data.nbytes for a in _arrays(caches))


def block_bytes(caches: list[list[KVCache]]) -> int:
    """The bytes of one block id across every stack's keys and values."""
    return sum(a.nbytes // a.shape[1] for a in _arrays(caches))
