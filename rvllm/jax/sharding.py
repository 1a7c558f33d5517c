"""Tensor parallelism for the JAX backend (``--tensor-parallel-size N``): a one-axis
``jax.sharding.Mesh`` of N devices, the weights placed on it Megatron-style with
``NamedSharding``s, the paged KV cache split by KV head, and the model's own step, written
for global shapes, partitioned by XLA (GSPMD). Nothing in ``rvllm.jax.model`` knows the
mesh: which array lives where is all this module decides.

The layout, by the weights' names (``rvllm.jax.weights``; stacked arrays carry the repeat
as their leading axis, ``[repeats, in, out]``):

- column-parallel, split along the output axis: ``qkv`` (and ``qkv_bias``), Gemma 4's
  ``q`` and ``kv``, ``gate_up``;
- row-parallel, split along the input axis: ``o``, ``down`` (their biases replicated: they
  are added after the partial products are summed);
- split by vocabulary: ``lm_head``;
- replicated: the embeddings, every norm, the RoPE tables, the windows and flags, Gemma
  4's per-layer-input weights and layer scales, and anything this list does not name.

The fused weights are split as stored, in equal slices of their output axis: a shard of
``qkv`` is a run of its columns, not each shard's heads of q, k and v, and a shard of
``gate_up`` is half of gate or of up, not both halves of its units. XLA still computes the
same result (a sharding never changes what a program computes); it moves the columns
where the next operation needs them, at the cost of a collective after those products
(see ``docs/jax.md``). A quantized linear, a dict such as ``{"w": int8, "scale": ...}``
under the same key, is split the same way: under a column-parallel key every array of it
along its last axis (the output channels); under a row-parallel key ``w`` along its input
axis, a scale with as many axes as ``w`` (per group of inputs) along the same axis, and a
per-output-channel scale replicated. An axis that does not divide by N is replicated
instead (JAX places only even shards)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rvllm.jax.weights import ModelSpec

# The mesh's one axis.
AXIS = "tp"

# Linear weights split along their output axis (the last), and those split along their
# input axis (the one before it), by their key in a layer's dict.
COLUMN_PARALLEL = frozenset({"qkv", "qkv_bias", "q", "kv", "gate_up"})
ROW_PARALLEL = frozenset({"o", "down"})
# Top-level weights split along their first axis (the vocabulary).
VOCAB_PARALLEL = frozenset({"lm_head"})

# The cache's KV-head axis: [repeats, num_blocks, block_size, kv_heads, head_dim].
CACHE_HEAD_AXIS = 3


def make_mesh(size: int, platform: str) -> Mesh:
    """A mesh of ``platform``'s first ``size`` devices along the axis ``AXIS``."""
    try:
        devices = jax.devices(platform)
    except RuntimeError as e:
        raise ValueError(f"--model-impl jax on the {platform}: this JAX has no {platform} "
                         "backend (for a GPU install jax[cuda12], for a TPU jax[tpu]).") from e
    if len(devices) < size:
        hint = ""
        if platform == "cpu":
            hint = (f" On the CPU, split the host into devices: set XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={size} in the environment "
                    "before starting (JAX reads it once, when its CPU backend starts).")
        raise ValueError(f"--tensor-parallel-size {size} needs {size} {platform} devices; "
                         f"JAX lists {len(devices)}.{hint}")
    return Mesh(np.array(devices[:size]), (AXIS,))


def check_divisible(spec: ModelSpec, size: int) -> None:
    """Refuse a model whose KV heads (of any layer kind that has a cache) do not divide by
    ``size``: the cache is split by KV head."""
    heads = sorted({kind.num_kv_heads for stack in spec.stacks for kind in stack.pattern
                    if kind.kv_source is None})
    if any(h % size for h in heads):
        counts = " and ".join(map(str, heads)) + (" KV head" if heads == [1] else " KV heads")
        common = int(np.gcd.reduce(heads))
        advice = (f"use a size that divides {common}" if common > 1
                  else "run it on one device (--tensor-parallel-size 1)")
        raise ValueError(f"--tensor-parallel-size {size} splits the KV cache by KV head, and "
                         f"{size} does not divide this model's {counts} a layer; {advice}.")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """Every key and value array's: split by KV head."""
    axes: list[str | None] = [None] * 5
    axes[CACHE_HEAD_AXIS] = AXIS
    return NamedSharding(mesh, PartitionSpec(*axes))


def cache_shardings(spec: ModelSpec, mesh: Mesh) -> list[list[dict[str, NamedSharding]]]:
    """The caches' shardings as a pytree of the caches' structure (``rvllm.jax.cache``):
    a KV-sharing layer's empty dict stays empty."""
    s = cache_sharding(mesh)
    return [[{} if kind.kv_source is not None else {"k": s, "v": s} for kind in stack.pattern]
            for stack in spec.stacks]


def _split(mesh: Mesh, shape: tuple[int, ...], axis: int | None, first: int = 0
           ) -> NamedSharding:
    """Split along ``axis`` (negative: from the end) if it is at or after ``first`` and
    divides by the mesh; replicated otherwise."""
    size = mesh.shape[AXIS]
    if axis is not None:
        axis %= max(len(shape), 1)
    if axis is None or axis < first or axis >= len(shape) or shape[axis] % size:
        return replicated(mesh)
    axes: list[str | None] = [None] * len(shape)
    axes[axis] = AXIS
    return NamedSharding(mesh, PartitionSpec(*axes))


def _linear(mesh: Mesh, value: Any, column: bool) -> Any:
    """A stacked linear weight's sharding (the repeat axis, 0, never split); a quantized
    one's (a dict of arrays) array by array."""
    if not isinstance(value, dict):
        if value.ndim < 2:
            return replicated(mesh)
        return _split(mesh, value.shape, -1 if column else -2, first=1)
    w = value.get("w")
    out = {}
    for name, a in value.items():
        if isinstance(a, dict):  # nothing known nests deeper: keep it whole
            out[name] = jax.tree.map(lambda _: replicated(mesh), a)
        elif column:
            out[name] = _split(mesh, a.shape, -1, first=1)
        elif name == "w" or (w is not None and a.ndim == w.ndim):
            out[name] = _split(mesh, a.shape, -2, first=1)
        else:  # per output channel, or per tensor: whole on every device
            out[name] = replicated(mesh)
    return out


def weight_shardings(weights: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    """The ``NamedSharding`` of every array of ``weights`` (a pytree of their structure)."""
    whole = lambda tree: jax.tree.map(lambda _: replicated(mesh), tree)  # noqa: E731
    out: dict[str, Any] = {}
    for key, value in weights.items():
        if key == "stacks":
            out[key] = [[{name: (_linear(mesh, a, name in COLUMN_PARALLEL)
                                 if name in COLUMN_PARALLEL or name in ROW_PARALLEL
                                 else whole(a))
                          for name, a in layer.items()} for layer in stack]
                        for stack in value]
        elif key in VOCAB_PARALLEL and not isinstance(value, dict):
            out[key] = _split(mesh, value.shape, 0)
        else:
            out[key] = whole(value)
    return out


def shard_weights(weights: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    """The weights placed on ``mesh`` with their shardings (``weight_shardings``)."""
    return jax.device_put(weights, weight_shardings(weights, mesh))


def jit_sharded(fn: Any, spec: ModelSpec, mesh: Mesh, num_outputs: int,
                static_argnames: tuple[str, ...] = ("spec",)) -> Any:
    """``fn`` (``rvllm.jax.model.step`` or ``greedy_steps``, whose last output is the
    caches) jitted for the mesh: the caches donated, every output replicated but the
    caches, which come back with the shardings they came in with, so XLA aliases them
    (updated in place) and the next call finds the shardings it was compiled for."""
    rep = replicated(mesh)
    out_shardings = (*[rep] * (num_outputs - 1), cache_shardings(spec, mesh))
    return jax.jit(fn, static_argnames=static_argnames, donate_argnames=("caches",),
                   out_shardings=out_shardings)
