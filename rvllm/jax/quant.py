"""Weight-only int8 and int4 linear weights for the JAX backend (``--quantization int8``,
``int4`` under ``--model-impl jax``).

A quantized linear weight is a dict in the weights' pytree in place of its ``[in, out]``
array (``K`` in, ``N`` out), so stacked layers stack it leaf by leaf like any array:

- int8: ``{"w": int8 [K, N], "scale": float32 [N]}``, symmetric per output channel (round
  to nearest of ``w / scale``, ``scale = max |w[:, n]| / 127``).
- int4: ``{"w": int4 [K, N], "scale": float32 [K / g, N]}``, symmetric per group of ``g``
  rows along K and per output channel (``scale = max |w[group, n]| / 7``, values in
  [-7, 7]). ``g`` is 128, or where K is no multiple of 128 its largest divisor below
  128 (SmolLM2's hidden size 576: 96); the step reads it from the shapes. The values are
  JAX's ``int4`` dtype: XLA stores it two to a byte on the CPU and on TPUs (its buffers
  take half an int8 array's memory) and converts it like any integer type.

``linear`` is the product the step computes at every such weight: the plain matmul for
an array; for a quantized dict the weight is widened to the activations' dtype inside the
jitted step (a temporary of the fused computation, never kept), the int8 scale applied to
the product's columns, the int4 group scales to the widened weight."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# --quantization values the JAX backend runs.
METHODS = ("int8", "int4")
# The per-layer linear weights quantized (every other weight stays in the model's dtype:
# embeddings, the LM head, norms, biases, Gemma 4's per-layer model projection).
LINEAR_KEYS = ("qkv", "q", "kv", "o", "gate_up", "down", "ple_gate", "ple_proj")
INT4_GROUP = 128

_LIMIT = {"int8": 127, "int4": 7}
_STORE = {"int8": np.dtype(np.int8), "int4": np.dtype(jnp.int4)}


def group_size(k: int, largest: int = INT4_GROUP) -> int:
    """The int4 group along an input of ``k``: ``largest``, or the largest divisor of
    ``k`` below it."""
    return next(g for g in range(min(largest, k), 0, -1) if k % g == 0)


def quantize(w: np.ndarray, method: str) -> dict[str, np.ndarray]:
    """``w`` [K, N] (any float dtype) as ``method``'s dict of integer values and float32
    scales."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS}, not {method!r}")
    w = np.asarray(w, np.float32)
    k, n = w.shape
    groups = 1 if method == "int8" else k // group_size(k)
    blocks = w.reshape(groups, k // groups, n)
    limit = _LIMIT[method]
    scale = np.abs(blocks).max(axis=1) / limit  # [groups, N]
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(blocks / scale[:, None, :]), -limit, limit).astype(np.int8)
    return {"w": q.reshape(k, n).astype(_STORE[method]),
            "scale": scale[0] if method == "int8" else scale}


def dequantize(q: dict[str, Any], dtype: Any = np.float32) -> Any:
    """The float [K, N] weight a quantized dict stands for (numpy or JAX arrays)."""
    xp = jnp if isinstance(q["w"], jax.Array) else np
    w, scale = q["w"], q["scale"]
    k, n = w.shape[-2:]
    if scale.ndim == w.ndim - 1:  # per channel
        return (w.astype(np.float32) * scale[..., None, :]).astype(dtype)
    groups = scale.shape[-2]
    blocks = w.astype(np.float32).reshape(*w.shape[:-2], groups, k // groups, n)
    return xp.reshape(blocks * scale[..., :, None, :], w.shape).astype(dtype)


def quantize_layer(parts: dict[str, Any], method: str | None) -> dict[str, Any]:
    """A layer's weights (``weights.py``'s per-layer dict) with its linear weights
    quantized by ``method`` (None: unchanged)."""
    if method is None:
        return parts
    return {key: quantize(value, method) if key in LINEAR_KEYS else value
            for key, value in parts.items()}


def linear(x: jax.Array, w: jax.Array | dict[str, jax.Array], precision: Any = None
           ) -> jax.Array:
    """``x @ w`` for a plain [K, N] weight or a quantized dict (one layer's: no stacked
    axis), in ``x``'s dtype."""
    if not isinstance(w, dict):
        return jnp.matmul(x, w, precision=precision)
    values, scale = w["w"], w["scale"]
    if scale.ndim == 1:  # int8 per output channel: scale the product's columns
        out = jnp.matmul(x, values.astype(x.dtype), precision=precision)
        return (out.astype(jnp.float32) * scale).astype(x.dtype)
    k, n = values.shape
    groups = scale.shape[0]
    weight = values.astype(jnp.float32).reshape(groups, k // groups, n) * scale[:, None, :]
    return jnp.matmul(x, weight.reshape(k, n).astype(x.dtype), precision=precision)


def is_quantized(w: Any) -> bool:
    return isinstance(w, dict) and "scale" in w


def stacked_bytes(tree: Any) -> int:
    """The bytes a pytree's arrays take at their dtypes' widths (int4: half a byte)."""
    def width(a: Any) -> float:
        dtype = np.dtype(a.dtype)
        bits = jnp.iinfo(dtype).bits if dtype.kind in "iu" or dtype == _STORE["int4"] \
            else dtype.itemsize * 8
        return a.size * bits / 8

    return int(sum(width(a) for a in jax.tree.leaves(tree)))
