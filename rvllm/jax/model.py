"""One engine step as one jitted JAX function: a ragged batch of prefill and decode tokens
through every layer (``lax.scan`` over each stack of weights), its keys and values written
into the paged cache, and the logits of the rows the sampler needs.

The step's inputs, padded to static buckets by the runner:

- ``token_ids``, ``positions``, ``slots`` [T]: the flattened new tokens of every scheduled
  sequence, each one's position in its sequence and cache slot (``block * block_size +
  offset``). Padding tokens have the slot ``num_blocks * block_size``: past the cache, so
  their writes are dropped.
- ``query_start`` [S + 1]: where each sequence's tokens start in the flat batch (the
  padding sequences start and end at the real token count).
- ``seq_lens`` [S]: each sequence's length after this step (0 for padding).
- ``block_tables`` [S, W]: each sequence's block ids (padded with block 0).
- ``logit_rows`` [R]: which flat rows need logits.

Attention reads each token's context from the cache through its sequence's block table,
a chunk of pages at a time with an online softmax (``paged_attention``): the memory it
needs is bounded by the chunk, not by the context. Each layer writes the step's keys and
values before it attends, so a sequence's new tokens attend to each other causally, as in
a prefill, and a prefix-cache hit or a recomputed sequence reads what its blocks hold."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from rvllm.jax.weights import ModelSpec, StackSpec

# How many (query token, key) pairs one chunk of paged attention gathers at most: the
# chunk's pages are sized from it and the step's token count.
ATTENTION_PAIRS_PER_CHUNK = 1 << 16

# Masked scores: finite, so a query with no key in a chunk (or none at all: padding)
# makes no NaN.
_MASKED = -1e30

# The event JAX reports for every backend compilation.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]


def _count_compile(event: str, duration: float, **_: Any) -> None:
    if event == _COMPILE_EVENT:
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compile_count() -> int:
    """How many XLA compilations this process has made since JAX was imported."""
    return _compiles[0]


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As transformers: normalise in float32, scale in the model's dtype.
    h = x.astype(jnp.float32)
    h = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return weight * h.astype(x.dtype)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE; x [T, H, D], cos and sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def _pages_per_chunk(num_tokens: int, block_size: int, width: int) -> int:
    pages = max(1, ATTENTION_PAIRS_PER_CHUNK // (num_tokens * block_size))
    return min(pages, width)


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                    token_tables: jax.Array, positions: jax.Array, limit: jax.Array,
                    window: jax.Array, precision: Any) -> jax.Array:
    """Each token's attention over its sequence's keys ``[max(0, position - window + 1),
    limit)`` read from the cache of ``layer``; q [T, Hq, D], token_tables [T, W] (each
    token's block table), limit [T] (0 for padding). Returns [T, Hq, D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    pages = _pages_per_chunk(num_tokens, block_size, token_tables.shape[1])
    chunk = pages * block_size
    width = -(-token_tables.shape[1] // pages) * pages
    token_tables = jnp.pad(token_tables, ((0, 0), (0, width - token_tables.shape[1])))
    qg = q.astype(jnp.float32).reshape(num_tokens, kv_heads, group, head_dim)
    qg = qg * (head_dim ** -0.5)
    lower = positions - window + 1
    num_chunks = (jnp.max(limit) + chunk - 1) // chunk

    def body(c: jax.Array, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, total, acc = state
        ids = lax.dynamic_slice_in_dim(token_tables, c * pages, pages, axis=1)  # [T, pages]
        keys = k_cache[layer, ids].reshape(num_tokens, chunk, kv_heads, head_dim)
        values = v_cache[layer, ids].reshape(num_tokens, chunk, kv_heads, head_dim)
        scores = jnp.einsum("thgd,tchd->thgc", qg, keys.astype(jnp.float32),
                            precision=precision)
        key_pos = c * chunk + jnp.arange(chunk)
        ok = (key_pos[None, :] < limit[:, None]) & (key_pos[None, :] >= lower[:, None])
        ok = ok[:, None, None, :]
        scores = jnp.where(ok, scores, _MASKED)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.where(ok, jnp.exp(scores - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        total = total * scale + jnp.sum(p, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("thgc,tchd->thgd", p,
                                                  values.astype(jnp.float32),
                                                  precision=precision)
        return m_new, total, acc

    shape = (num_tokens, kv_heads, group)
    init = (jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32))
    _, total, acc = lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.maximum(total, 1e-30)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _stack_forward(spec: ModelSpec, stack: StackSpec, weights: dict[str, Any],
                   cache: dict[str, jax.Array], h: jax.Array, cos: jax.Array,
                   sin: jax.Array, positions: jax.Array, slots: jax.Array,
                   token_tables: jax.Array, limit: jax.Array, precision: Any
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The hidden states through every layer of one stack, a ``lax.scan`` whose carry
    holds the stack's caches (so each layer's write updates them in place)."""
    num_tokens = h.shape[0]
    heads, kv_heads, head_dim = stack.num_heads, stack.num_kv_heads, stack.head_dim
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    block_size = cache["k"].shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    dot = partial(jnp.matmul, precision=precision)

    def layer(carry: tuple[jax.Array, ...], xs: tuple[Any, jax.Array]
              ) -> tuple[tuple[jax.Array, ...], None]:
        h, k_cache, v_cache = carry
        w, index = xs
        x = _rms_norm(h, w["input_norm"], spec.rms_norm_eps)
        qkv = dot(x, w["qkv"])
        if stack.qkv_bias:
            qkv = qkv + w["qkv_bias"]
        q = qkv[:, :q_size].reshape(num_tokens, heads, head_dim)
        k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, kv_heads, head_dim)
        v = qkv[:, q_size + kv_size:].reshape(num_tokens, kv_heads, head_dim)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k_cache = k_cache.at[index, blocks, offsets].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[index, blocks, offsets].set(v.astype(v_cache.dtype), mode="drop")
        attn = paged_attention(q, k_cache, v_cache, index, token_tables, positions, limit,
                               w["window"], precision)
        out = dot(attn.reshape(num_tokens, q_size), w["o"])
        if stack.o_bias:
            out = out + w["o_bias"]
        h = h + out
        x = _rms_norm(h, w["post_norm"], spec.rms_norm_eps)
        gate, up = jnp.split(dot(x, w["gate_up"]), 2, axis=-1)
        h = h + dot(jax.nn.silu(gate) * up, w["down"])
        return (h, k_cache, v_cache), None

    indices = jnp.arange(stack.num_layers)
    (h, k_cache, v_cache), _ = lax.scan(layer, (h, cache["k"], cache["v"]), (weights, indices))
    return h, {"k": k_cache, "v": v_cache}


def step(weights: dict[str, Any], caches: list[dict[str, jax.Array]], token_ids: jax.Array,
         positions: jax.Array, slots: jax.Array, query_start: jax.Array,
         seq_lens: jax.Array, block_tables: jax.Array, logit_rows: jax.Array, *,
         spec: ModelSpec) -> tuple[jax.Array, list[dict[str, jax.Array]]]:
    """The logits (float32 [R, vocab]) of ``logit_rows`` and the updated caches."""
    precision = lax.Precision.HIGHEST if spec.full_precision else None
    num_tokens = token_ids.shape[0]
    # Each token's sequence: how many sequences end at or before it.
    seq_of_token = jnp.searchsorted(query_start[1:], jnp.arange(num_tokens), side="right")
    seq_of_token = jnp.minimum(seq_of_token, block_tables.shape[0] - 1)
    real = jnp.arange(num_tokens) < query_start[-1]
    # Keys [.., limit) are this token's context: its own position and those before.
    limit = jnp.where(real, jnp.minimum(positions + 1, seq_lens[seq_of_token]), 0)
    token_tables = block_tables[seq_of_token]
    cos, sin = weights["rope"]["cos"][positions], weights["rope"]["sin"][positions]
    h = weights["embed"][token_ids]
    new_caches = []
    for stack, stack_weights, cache in zip(spec.stacks, weights["stacks"], caches):
        h, cache = _stack_forward(spec, stack, stack_weights, cache, h, cos, sin, positions,
                                  slots, token_tables, limit, precision)
        new_caches.append(cache)
    rows = _rms_norm(h[logit_rows], weights["final_norm"], spec.rms_norm_eps)
    head = weights["embed"] if spec.tied_embeddings else weights["lm_head"]
    logits = jnp.einsum("rh,vh->rv", rows, head, precision=precision)
    return logits.astype(jnp.float32), new_caches


# One jitted step for the process: engines with the same model shapes, cache and buckets
# share its compilations. The caches are donated: the step updates them in place.
jitted_step = jax.jit(step, static_argnames=("spec",), donate_argnames=("caches",))
